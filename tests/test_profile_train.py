"""train.profile: a profiler window over real steps writes an operator table (bad values: test_config_errors)."""


def test_profile_window_writes_the_operator_table_of_the_profiled_steps(run_train, tmp_path):
    # the window (steps 2..5) outlasts the run (3 steps): the run's end still writes what it saw
    run = run_train(["train.steps=3", "train.profile.start_step=2", "train.profile.steps=4", "train.eval_iters=0",
                     f"train.profile.dir={tmp_path / 'prof'}"]).check()  # fmt: skip
    table = (tmp_path / "prof" / "rank0_ops.txt").read_text()
    assert table.startswith("steps 2..5, sorted by self_cpu_time_total")
    assert "aten::mm" in table  # the model's GEMMs ran inside the window
    assert not (tmp_path / "prof" / "rank0_trace.json").exists()  # the trace is opt-in
    assert sorted(run.losses()) == [1, 2, 3]

