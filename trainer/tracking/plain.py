"""A recorded run's plain-loop reference: the same config run again as a plain loop, in a fresh
process (`python -m trainer.tools.plain_loop --config`), its figures logged on the run.

`python -m trainer.report --plain` calls `annotate`. The plain loop is run as a program, not
imported: the records sit below the loop and the tools built on it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile


def run_script(config_path: str) -> dict:
    """`trainer.tools.plain_loop` on a saved config, in a fresh process (a plain script, as the reference must be)."""
    proc = subprocess.run([sys.executable, "-m", "trainer.tools.plain_loop", "--config", config_path],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def annotate(client, runs, log=print) -> None:
    """Give each finished single-process run its plain-loop reference: the same config, run
    again as a plain loop, logged on the run as `plain_*` metrics and `engine_vs_plain`
    (the run's ms/step over the plain loop's). Runs that already have one are left alone."""
    for r in runs:
        metrics = r.data.metrics
        if (r.info.status != "FINISHED" or "ms_per_step" not in metrics or "plain_ms_per_step" in metrics
                or int(r.data.tags.get("world_size", "1")) > 1):
            continue
        with tempfile.TemporaryDirectory(prefix="feedbench-plain-") as tmp:
            path = client.download_artifacts(r.info.run_id, "config.yaml", tmp)
            try:
                figures = run_script(path)
            except RuntimeError as e:
                log(f"warning: no plain-loop reference for run {r.info.run_name!r}: {e}")
                continue
        if not figures.get("plain_timed_steps"):
            continue
        figures["engine_vs_plain"] = metrics["ms_per_step"] / figures["plain_ms_per_step"]
        for key, value in figures.items():
            client.log_metric(r.info.run_id, key, float(value))
        r.data.metrics.update(figures)  # so a table built from these runs shows them
        log(f"{r.info.run_name}: engine {metrics['ms_per_step']:.3f} ms/step, "
            f"plain loop {figures['plain_ms_per_step']:.3f}, ratio {figures['engine_vs_plain']:.3f}")
