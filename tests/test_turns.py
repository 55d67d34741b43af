"""`trainer.tools.turns`: processes that take turns, and the steps counted inside each one's turns."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from clirun import check_turns_run
from trainer.config import PROJECT_ROOT
from trainer.tools.turns import PAUSE_ENV, Turn, pause_if_asked, take_turns, turn_rates

# A stand-in loop: a second of setup that differs per process, then it stops itself where its
# timed region begins (as the engine and the plain loop do) and records the clock while it spins.
SPINNER = textwrap.dedent("""
    import sys, time
    import numpy as np
    from trainer.tools.turns import pause_if_asked
    time.sleep(float(sys.argv[2]))  # setup
    pause_if_asked()
    seen, end = [], time.perf_counter() + float(sys.argv[3])
    while time.perf_counter() < end:
        seen.append(time.perf_counter())
    np.save(sys.argv[1], np.array(seen))
""")


def test_pause_does_nothing_outside_turns(monkeypatch):
    monkeypatch.delenv(PAUSE_ENV, raising=False)
    pause_if_asked()  # would stop this test's own process group if it did anything


def test_processes_run_one_at_a_time_from_their_timed_region(tmp_path):
    script = tmp_path / "spin.py"
    script.write_text(SPINNER)
    clocks = [tmp_path / "a.npy", tmp_path / "b.npy"]
    # Different setup times (0.2 s, 1.0 s); each spins for 0.6 s of its own running time.
    cmds = [[sys.executable, str(script), str(clocks[0]), "0.2", "0.6"],
            [sys.executable, str(script), str(clocks[1]), "1.0", "0.6"]]
    turns = take_turns(cmds, [tmp_path / "a.log", tmp_path / "b.log"], PROJECT_ROOT, turn_s=0.05)
    a, b = (np.load(c) for c in clocks)
    # Turns alternate, starting with the first command, and follow each other in time.
    assert [t.who for t in turns] == [i % 2 for i in range(len(turns))] and len(turns) >= 6
    assert all(t.start < t.end <= u.start for t, u in zip(turns, turns[1:]))
    # Neither began spinning before both had finished their setup: the first turn starts the spin.
    assert min(a[0], b[0]) >= turns[0].start
    # While both were alive, each one's clock readings fall in its own turns: never at once. A turn's
    # `end` is read just before its SIGSTOP is sent, and the stop lands later (later still when
    # the machine is loaded); the next turn starts only once it has: readings up to that start
    # are still this process's alone.
    last = turns[-1].end
    for who, seen in ((0, a), (1, b)):
        inside = seen[seen < last]
        in_turn = np.zeros(len(inside), dtype=bool)
        for t, until in zip(turns, [u.start for u in turns[1:]] + [last]):
            if t.who == who:
                in_turn |= (inside >= t.start) & (inside <= until)
        assert in_turn.all(), f"process {who} ran outside its turns"


def test_a_failing_process_is_named_and_nothing_is_left_stopped(tmp_path):
    script = tmp_path / "spin.py"
    script.write_text(SPINNER)
    cmds = [[sys.executable, str(script), str(tmp_path / "a.npy"), "0.1", "30"],
            [sys.executable, "-c", "from trainer.tools.turns import pause_if_asked; pause_if_asked(); raise SystemExit(3)"]]
    with pytest.raises(RuntimeError, match="exit 3"):
        take_turns(cmds, [tmp_path / "a.log", tmp_path / "b.log"], PROJECT_ROOT, turn_s=0.05)
    ps = subprocess.run(["ps", "-eo", "stat,args"], capture_output=True, text=True).stdout
    assert str(tmp_path / "a.npy") not in ps  # the spinner was ended, not left stopped
    # ... and not waited for: its 30 s of spinning (saved at their end) were cut short by the failure
    assert not (tmp_path / "a.npy").exists()


U = 2.0 ** -10  # a time unit of about 1 ms that binary floating point holds exactly


def test_turn_rates_count_only_whole_steps_inside_own_turns_after_settling():
    # Process 0: steps of 1 U from t=0; process 1: steps of 2 U. Turns of 10 U, alternating.
    turns = [Turn(i % 2, i * 10 * U, (i + 1) * 10 * U) for i in range(6)]
    starts = [np.arange(61) * U, np.arange(31) * 2 * U]
    out = turn_rates(starts, turns, settle_s=2 * U)
    # Process 0's turns [0,10), [20,30), [40,50): steps beginning >= 2 U into the turn and ending
    # by its end: 8 per turn. Process 1's: steps of 2 U from 2 U in: 4 per turn.
    assert out["steps"] == [24, 12]
    assert out["ms_per_step"] == pytest.approx([U * 1e3, 2 * U * 1e3])
    assert out["pair_ratios"] == pytest.approx([2.0, 2.0, 2.0]) and out["turns"] == 6


def test_turn_rates_stop_counting_when_the_first_process_ends():
    turns = [Turn(i % 2, i * 10 * U, (i + 1) * 10 * U) for i in range(6)]
    starts = [np.arange(31) * U, np.arange(61) * U]  # process 0's loop ends at 30 U
    out = turn_rates(starts, turns, settle_s=0.0)
    # Only steps ending by 30 U count: process 0's turns [0,10), [20,30); process 1's [10,20).
    assert out["steps"] == [20, 10] and out["ms_per_step"] == pytest.approx([U * 1e3, U * 1e3])
    one_start = turn_rates([starts[0], np.array([50 * U])], turns)  # no whole step: none counted
    assert one_start["steps"] == [0, 0] and math.isnan(one_start["ms_per_step"][1])


@pytest.mark.slow  # versus in turns also runs by default in tests/test_lightning.py
def test_versus_compares_two_configurations_in_turns(tmp_path, capsys):
    """`python -m trainer.versus --a ... --b ...`: two CLI runs at once, taking turns; each side's
    ms/step over its own turns, and the ratio a ÷ b."""
    from trainer.versus import main
    table = tmp_path / "versus.md"
    main(["--a", "loader=pinned_gather", "--a", "loader.threads=2", "--b", "loader=pinned_chunk", "--repeats", "1",
          "--turn-ms", "20", "--settle-ms", "2", "--markdown", str(table), "model=noop", "engine.device=cpu",
          "dataset.num_samples=96", "dataset.shape=[8,8]", "loader.batch_size=16", "engine.max_steps=3000",
          "engine.warmup_steps=10"])
    got, cells = check_turns_run(capsys.readouterr().out, table, "`loader=pinned_gather`", max_steps=3000)
    assert cells[1:4] == ["`loader=pinned_chunk`", "no", "turns"]
    assert float(cells[4]) == pytest.approx(got["first"], abs=1e-3)
    assert float(cells[5]) == pytest.approx(got["second"], abs=1e-3)
    assert cells[7] != "–"  # adjacent turns give an interval


def test_versus_needs_something_to_compare_and_a_valid_override():
    from trainer.versus import main
    with pytest.raises(SystemExit, match="--a loader=pinned_gather --b loader=pinned_chunk"):
        main(["model=noop"])
    with pytest.raises(SystemExit, match="loader.depthh"):
        main(["--a", "loader=pinned_gather", "--b", "loader.depthh=2", "engine.device=cpu"])
