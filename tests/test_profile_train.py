"""Where a step's time goes: train.profile's profiler window over real steps writes an operator table (bad values:
test_config_errors); train.time_compute logs each step's forward-backward apart from the rest."""


def test_profile_window_writes_the_operator_table_of_the_profiled_steps(run_train, tmp_path):
    # the window (steps 2..5) outlasts the run (3 steps): the run's end still writes what it saw
    run = run_train(["train.steps=3", "train.profile.start_step=2", "train.profile.steps=4", "train.eval_iters=0",
                     f"train.profile.dir={tmp_path / 'prof'}"]).check()  # fmt: skip
    table = (tmp_path / "prof" / "rank0_ops.txt").read_text()
    assert table.startswith("steps 2..5, sorted by self_cpu_time_total")
    assert "aten::mm" in table  # the model's GEMMs ran inside the window
    assert not (tmp_path / "prof" / "rank0_trace.json").exists()  # the trace is opt-in
    assert sorted(run.losses()) == [1, 2, 3]
    assert all("compute_s" not in r for r in run.records("train"))  # timed apart only when asked (a device sync)


def test_time_compute_logs_each_steps_forward_backward_as_part_of_its_time(run_train):
    run = run_train(["train.steps=3", "train.eval_iters=0", "train.time_compute=true"]).check()
    records = run.records("train")
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:  # the forward-backward, then the gradients' finalisation, the update and the loss read
        assert 0 < r["compute_s"] < r["step_time_s"], r

