"""A recorded run's plain-loop reference: the same config run again as a plain loop, in a fresh
process (`python -m trainer.tools.plain_loop --config`), its figures logged on the run.

`python -m trainer.report --plain` calls `annotate`. The plain loop is run as a program, not
imported: the records sit below the loop and the tools built on it. It runs now, not beside the
run it annotates: its figures are logged with the tag `plain_timed` saying when, and no ratio of
the two is logged, for a ratio of two timings taken at different times on a host whose speed
drifts is not a measurement (what the engine costs is measured in turns: `python -m trainer.overhead`).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time

# Said beside a ratio of the run's ms/step to its plain loop's: why it is not a figure of the run.
ACROSS_TIME = ("not a measurement: the plain loop was timed now, the run when it ran, on a host whose speed drifts "
               "(what the engine costs, timed in turns: python -m trainer.overhead)")


def run_script(config_path: str) -> dict:
    """`trainer.tools.plain_loop` on a saved config, in a fresh process (a plain script, as the reference must be)."""
    proc = subprocess.run([sys.executable, "-m", "trainer.tools.plain_loop", "--config", config_path],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def annotate(client, runs, log=print) -> None:
    """Give each finished single-process run its plain-loop reference: the same config, run
    again as a plain loop now, logged on the run as `plain_*` metrics with the tag `plain_timed`
    (when, after the run). Runs that already have one are left alone. The ratio of the two is
    printed, marked as no measurement (`ACROSS_TIME`), never logged."""
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
        when = f"after the run, at {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} (report --plain)"
        for key, value in figures.items():
            client.log_metric(r.info.run_id, key, float(value))
        client.set_tag(r.info.run_id, "plain_timed", when)
        r.data.metrics.update(figures)  # so a table built from these runs shows them
        r.data.tags["plain_timed"] = when
        log(f"{r.info.run_name}: engine {metrics['ms_per_step']:.3f} ms/step when it ran, plain loop "
            f"{figures['plain_ms_per_step']:.3f} now; their ratio {metrics['ms_per_step'] / figures['plain_ms_per_step']:.3f} "
            f"is {ACROSS_TIME}")
