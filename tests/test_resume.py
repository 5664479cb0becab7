"""Kill a run (SIGKILL) after it has written a checkpoint, resume it, and get the losses of the
uninterrupted run; an interrupted save never looks like a checkpoint; no process of the killed
run outlives it."""

import contextlib
import os
import signal
import subprocess
import time

from loong_train.testing import TINY, train_command
from loong_xpu.testing import launch_env, live_session_processes

STEPS = 24
COMMON = [f"train.steps={STEPS}", "train.save_interval=4", "train.eval_interval=0", "train.keep_last=10"]


def test_killed_run_resumes_on_the_same_loss_curve(run_train, tmp_path, data_cache):
    uninterrupted = run_train(COMMON, name="uninterrupted").check().losses()

    out = tmp_path / "killed"
    args = [*TINY, f"data.cache_dir={data_cache}", f"train.output_dir={out}", *COMMON]
    # its own session: every process it starts (megatron's checkpoint-writer manager) is findable
    proc = subprocess.Popen(train_command(args), cwd=tmp_path, env=launch_env(), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        latest = out / "checkpoints" / "latest"
        deadline = time.time() + 300
        while not latest.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait() == -signal.SIGKILL, "the run finished before it could be killed"
        deadline = time.time() + 10
        while live_session_processes(proc.pid) and time.time() < deadline:
            time.sleep(0.1)
        assert not live_session_processes(proc.pid), "processes of the killed trainer outlived it"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the test leaves nothing behind, whatever failed
    killed_at = int(latest.read_text().strip().removeprefix("step_"))
    assert 0 < killed_at < STEPS

    resumed = run_train([*COMMON, "resume=true"], name="killed").check()
    assert f"(step {killed_at})" in resumed.stderr
    losses = resumed.losses()
    assert sorted(losses) == list(range(1, STEPS + 1)), "metrics must hold each step exactly once"
    for step in range(1, STEPS + 1):
        assert abs(losses[step] - uninterrupted[step]) <= 1e-5, (step, losses[step], uninterrupted[step])
