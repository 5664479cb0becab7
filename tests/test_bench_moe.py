"""The CPU side of bench/moe_throughput.py: arguments, the commands it launches, the MFU formula."""

import dataclasses
from pathlib import Path

import pytest

from loong_train.testing import load_script

_PATH = Path(__file__).parents[1] / "bench" / "moe_throughput.py"
bench = load_script(_PATH)


def test_defaults_are_the_issue_shape():
    args = bench.parse_args([])
    assert (args.model, args.layers, args.seq, args.gpus, args.ep) == ("qwen3-30b-a3b", 4, 4096, 4, 4)
    assert args.variants == ["baseline", "a2a-overlap", "offload"]
    f = bench.foundation(args)
    assert (f.num_layers, f.moe.num_experts, f.moe.router_topk) == (4, 128, 8)


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        bench.parse_args(["--gpus", "4", "--ep", "3"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--steps", "5", "--warmup", "5"])
    with pytest.raises(SystemExit):  # megatron's host offload runs on the precision-aware path
        bench.parse_args(["--variants", "baseline", "offload-optimizer"])


def test_optimizer_offload_is_compared_against_a_precision_aware_baseline(tmp_path):
    args = bench.parse_args(["--precision-aware", "--optimizer-offload-fraction", "0.5",
                             "--variants", "baseline", "offload-optimizer"])  # fmt: skip
    base = bench.train_command(args, "baseline", tmp_path / "b")
    offload = bench.train_command(args, "offload-optimizer", tmp_path / "o")
    assert "optim.precision_aware=true" in base and "optim.precision_aware=true" in offload
    assert set(offload) - set(base) == {"optim.offload_fraction=0.5", "optim.offload_update=host",
                                        f"train.output_dir={tmp_path / 'o'}"}  # fmt: skip
    device = bench.train_command(args, "offload-optimizer-device@1", tmp_path / "d")
    assert set(device) - set(base) == {"optim.offload_fraction=1.0", "optim.offload_update=device",
                                       f"train.output_dir={tmp_path / 'd'}"}  # fmt: skip
    remainder = bench.train_command(args, "offload-optimizer-remainder@1", tmp_path / "r")
    assert set(remainder) - set(device) == {"optim.offload_master=remainder", f"train.output_dir={tmp_path / 'r'}"}


def test_one_run_compares_several_optimizer_offload_shares(tmp_path):
    args = bench.parse_args(["--precision-aware", "--optimizer-offload-fraction", "0.5",
                             "--variants", "baseline", "offload-optimizer@1", "offload-optimizer@0.6", "offload-optimizer"])  # fmt: skip
    commands = [bench.train_command(args, v, tmp_path / str(i)) for i, v in enumerate(args.variants)]
    shares = [[a for a in c if a.startswith("optim.offload_fraction=")] for c in commands]
    assert shares == [[], ["optim.offload_fraction=1.0"], ["optim.offload_fraction=0.6"], ["optim.offload_fraction=0.5"]]
    for bad in ("offload-optimizer@0", "offload-optimizer@1.5", "offload-optimizer@x", "a2a-overlap@0.5", "nope"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--precision-aware", "--variants", "baseline", bad])
    with pytest.raises(SystemExit):  # the precision-aware check sees a share's variant too
        bench.parse_args(["--variants", "baseline", "offload-optimizer@0.6"])


def test_each_variant_is_its_own_torchrun_job(tmp_path):
    args = bench.parse_args(["--gpus", "2", "--variants", "baseline", "a2a-overlap"])
    base = bench.train_command(args, "baseline", tmp_path / "baseline")
    overlap = bench.train_command(args, "a2a-overlap", tmp_path / "a2a")
    assert "--nproc-per-node=2" in base and "loong_train" in base
    for arg in (
        "parallel.ep=2",
        "train.dtype=bf16",
        "train.global_batch_size=8",
        "model.foundation.num_layers=4",
    ):
        assert arg in base
    assert set(overlap) - set(base) == {
        "parallel.moe_a2a_overlap=true",
        f"train.output_dir={tmp_path / 'a2a'}",
    }
    offload = bench.train_command(args, "offload", tmp_path / "o")
    assert "parallel.offload_activations=[expert_fc1,moe_act]" in offload
    everything = bench.train_command(args, "offload-all", tmp_path / "a")
    points = "attn_norm,qkv_linear,core_attn,attn_proj,mlp_norm,expert_fc1,moe_act"
    assert f"parallel.offload_activations=[{points}]" in everything


def test_numa_binding_is_a_torchrun_option_for_every_variant(tmp_path):
    from torch.distributed.run import get_args_parser

    args = bench.parse_args(["--gpus", "2", "--numa-binding", "exclusive"])
    for variant in args.variants:
        cmd = bench.train_command(args, variant, tmp_path / variant)
        launcher = get_args_parser().parse_args(cmd[cmd.index("torch.distributed.run") + 1 :])
        assert launcher.numa_binding == "exclusive" and launcher.training_script == "loong_train"
    plain = bench.train_command(bench.parse_args(["--gpus", "2"]), "baseline", tmp_path / "b")
    assert not any(arg.startswith("--numa-binding") for arg in plain)
    with pytest.raises(SystemExit):
        bench.parse_args(["--numa-binding", "everywhere"])


def test_levers_reach_every_variant_and_validate_in_the_train_app(tmp_path):
    from loong_train.main import to_config
    from loong_train.schema import validate
    from loong_train.testing import compose_config

    args = bench.parse_args(["--levers", "--variants", "baseline", "a2a-overlap"])
    plain = bench.train_command(bench.parse_args(["--variants", "baseline"]), "baseline", tmp_path / "b")
    for variant in args.variants:
        cmd = bench.train_command(args, variant, tmp_path / "b")
        assert set(bench.LEVERS) <= set(cmd) and not set(bench.LEVERS) & set(plain)
    # the overrides are keys the train app knows (parallel.wgrad_fusion; megatron's MoE fusion flags
    # through the foundation's extra fields)
    command = bench.train_command(args, "a2a-overlap", tmp_path / "a")
    overrides = [a for a in command if "=" in a and "--" not in a]
    cfg = to_config(compose_config(*overrides))
    assert cfg.parallel.wgrad_fusion is True and cfg.parallel.moe_a2a_overlap is True
    assert cfg.model.foundation.extra == {"moe_permute_fusion": True, "moe_router_fusion": True}
    validate(cfg, world_size=4)


def test_mfu_counts_active_parameters():
    f = bench.foundation(bench.parse_args([]))
    # 4 layers of qwen3-30b-a3b: attention 18,874,624 + router 262,144 + 8 of 128 experts 37,748,736
    # + norms 4,096 per layer; embeddings and head 622,329,856; final norm 2,048
    active = 4 * (18_874_624 + 262_144 + 37_748_736 + 4_096) + 622_329_856 + 2_048
    assert f.num_active_parameters() == active
    expected = (6 * active + 6 * 4 * 2048 * 4096) * 10_000 / 989e12
    assert bench.mfu(f, 4096, 10_000) == pytest.approx(expected, rel=1e-12)


def test_table_reports_ratios_against_the_baseline():
    args = bench.parse_args(["--gpus", "2"])
    f = bench.foundation(args)
    rows = [
        bench.Result("baseline", 1.0, 1000.0, 0.1, 20.0),
        bench.Result("a2a-overlap", 0.8, 1250.0, 0.125, 21.0),
    ]
    text = bench.table(args, f, rows)
    assert "1.250x" in text and "1.000x" in text and "2 GPUs, EP 2" in text


def test_the_paired_ratio_compares_each_step_with_the_baselines_same_step():
    # the baseline's steps drift (slow, fast, slow) and the variant follows them 10% slower: the
    # medians' ratio sees a different step on each side, the pairs see 10% at every step
    base = bench.Result("baseline", 7.0, 1.0, 0.1, 20.0, 12.3, (9.0, 6.0, 7.0, 6.5, 9.5))
    slow = bench.Result("offload-optimizer-device@1", 9.9, 1.0, 0.1, 12.0, 12.3, (9.9, 6.6, 7.7, 7.15, 10.45))
    assert bench.paired_ratio(base, slow) == pytest.approx(1 / 1.1)
    text = bench.table(bench.parse_args(["--gpus", "4"]), bench.foundation(bench.parse_args([])), [base, slow])
    assert "0.909x" in text and "paired" in text
    with pytest.raises(ValueError):  # runs of different lengths are not paired silently
        bench.paired_ratio(base, bench.Result("x", 1.0, 1.0, 0.1, 1.0, 12.3, (1.0,)))


def test_rounds_alternate_the_order_and_pool_every_measured_step():
    assert bench.run_order(["baseline", "offload"], 3) == [
        (0, "baseline"), (0, "offload"), (1, "offload"), (1, "baseline"), (2, "baseline"), (2, "offload")]  # fmt: skip
    args = bench.parse_args(["--gpus", "4", "--rounds", "2", "--microbatches", "64"])
    f = bench.foundation(args)
    first = bench.Result("baseline", 7.0, 0.0, 0.0, 19.5, 12.31, (7.0, 6.0, 8.0))
    second = bench.Result("baseline", 9.0, 0.0, 0.0, 19.6, 12.40, (9.0, 9.5, 8.5))
    both = bench.pooled(args, f, [first, second])
    assert both.step_times == (7.0, 6.0, 8.0, 9.0, 9.5, 8.5) and both.step_s == 8.25
    assert both.peak_gib == 19.6 and both.first_loss == 12.31
    assert both.tokens_per_s_per_gpu == pytest.approx(64 * 4096 / 8.25)
    assert bench.pooled(args, f, [first]).step_s == 7.0  # one round: the run's own median
    for bad in (["--rounds", "0"], ["--rounds", "2", "--profile-dir", "/tmp/p"], ["--variants", "baseline", "baseline"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_variants_whose_first_losses_differ_are_not_the_same_samples():
    rows = [bench.Result("baseline", 1.0, 1000.0, 0.1, 20.0, 12.3143), bench.Result("a2a-overlap", 0.8, 1250.0, 0.125, 21.0, 12.3143)]
    assert "agree within 0.01 (12.3143)" in bench.check_same_samples(rows)
    rows.append(bench.Result("offload", 1.0, 1000.0, 0.1, 18.0, 12.5))
    with pytest.raises(SystemExit, match=r"step-1 loss of offload 12.5000 vs baseline 12.3143"):
        bench.check_same_samples(rows)
    with pytest.raises(SystemExit, match="nan"):  # a run without a loss cannot pass
        bench.check_same_samples([rows[0], bench.Result("x", 1.0, 1.0, 0.1, 1.0)])


def test_a_profiled_step_comes_after_the_measured_ones(tmp_path):
    args = bench.parse_args(["--steps", "7", "--profile-dir", str(tmp_path / "prof")])
    cmd = bench.train_command(args, "a2a-overlap", tmp_path / "a")
    assert "train.steps=8" in cmd and "train.profile.start_step=8" in cmd
    assert f"train.profile.dir={tmp_path / 'prof' / 'a2a-overlap'}" in cmd


def _save(path, args, order, times, loss=12.315, device="NVIDIA H200"):
    for i, variant in enumerate(order):
        step_s = sorted(times[variant])[len(times[variant]) // 2]
        r = bench.Result(variant, step_s, 0.0, 0.0, {"baseline": 51.41}.get(variant, 23.24), loss, times[variant])
        bench.save_run(path, args, 0, i == 0, r, device)


def test_runs_saved_by_two_invocations_pool_as_rounds_of_one(tmp_path, capsys):
    # one order per invocation (a lent machine's call could not hold both rounds): A B, then B A
    args = bench.parse_args(["--gpus", "1", "--precision-aware", "--microbatches", "64", "--steps", "6", "--warmup", "3",
                             "--variants", "baseline", "offload-optimizer-device@1"])  # fmt: skip
    reverse = bench.parse_args(["--gpus", "1", "--precision-aware", "--microbatches", "64", "--steps", "6", "--warmup", "3",
                                "--variants", "offload-optimizer-device@1", "baseline"])  # fmt: skip
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    _save(a, args, args.variants, {"baseline": (14.42, 13.811, 14.83), "offload-optimizer-device@1": (15.338, 14.053, 16.719)})
    _save(b, reverse, reverse.variants, {"baseline": (18.561, 15.924, 16.667), "offload-optimizer-device@1": (16.85, 16.13, 14.36)})
    bench.main(["--pool", str(a), str(b)])
    out = capsys.readouterr().out
    # pooled medians: baseline (14.83 + 15.924) / 2, offload (15.338 + 16.13) / 2
    assert " 15.377 " in out and " 15.734 " in out
    assert f"{15.377 / 15.734:.3f}x" in out  # the medians' ratio, 0.977x
    pairs = sorted([14.42 / 15.338, 13.811 / 14.053, 14.83 / 16.719, 18.561 / 16.85, 15.924 / 16.13, 16.667 / 14.36])
    assert f"{(pairs[2] + pairs[3]) / 2:.3f}x" in out  # each step against the same step of the same round
    assert "2 rounds pooled (ran first in its round: baseline 1x, offload-optimizer-device@1 1x)" in out
    assert "same samples: the step-1 losses of all 4 runs agree" in out and "NVIDIA H200" in out


def test_pooling_refuses_runs_of_other_settings_or_samples_and_a_round_short_of_a_variant(tmp_path):
    args = bench.parse_args(["--gpus", "1", "--variants", "baseline", "a2a-overlap"])
    times = {"baseline": (1.0, 1.1), "a2a-overlap": (0.9, 1.0)}
    a, other, drifted, short = (tmp_path / f"{n}.jsonl" for n in ("a", "other", "drifted", "short"))
    _save(a, args, args.variants, times)
    _save(other, bench.parse_args(["--gpus", "1", "--microbatches", "8", "--variants", "baseline", "a2a-overlap"]),
          args.variants, times)  # fmt: skip
    with pytest.raises(SystemExit, match=r"other.jsonl:1: run of baseline has microbatches=8, the first run microbatches=4"):
        bench.main(["--pool", str(a), str(other)])
    _save(drifted, args, args.variants, times, loss=12.6)
    with pytest.raises(SystemExit, match="not the same samples"):  # every run is checked, not only the first round's
        bench.main(["--pool", str(a), str(drifted)])
    _save(short, args, ["baseline"], times)
    with pytest.raises(SystemExit, match=r"short.jsonl: round 1 has no run of a2a-overlap; .* paired round by round"):
        bench.main(["--pool", str(a), str(short)])
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(SystemExit, match=r"bad.jsonl:1: not a run saved by --save-runs"):
        bench.main(["--pool", str(tmp_path / "bad.jsonl")])


def test_time_compute_reaches_every_variant_and_splits_the_table(tmp_path):
    args = bench.parse_args(["--time-compute", "--precision-aware", "--variants", "baseline", "offload-optimizer-device@1"])
    for variant in args.variants:
        assert "train.time_compute=true" in bench.train_command(args, variant, tmp_path / "x")
    assert "train.time_compute=true" not in bench.train_command(bench.parse_args([]), "baseline", tmp_path / "x")
    # the forward-backward spreads (15, 14, 16 s) and differs between the runs; the rest does not
    base = bench.Result("baseline", 15.4, 1.0, 0.1, 51.4, 12.3, (15.4, 14.3, 16.4), (15.0, 13.9, 16.0))
    device = bench.Result("offload-optimizer-device@1", 16.0, 1.0, 0.1, 23.2, 12.3, (16.0, 14.0, 17.2), (15.2, 13.2, 16.4))
    assert bench.rest_times(device) == pytest.approx([0.8, 0.8, 0.8])
    text = bench.table(args, bench.foundation(args), [base, device])
    line = next(ln for ln in text.splitlines() if ln.startswith("offload-optimizer-device@1") and "+" in ln)
    assert line.split() == ["offload-optimizer-device@1", "15.200", "0.800", "+0.400", f"{15.4 / 15.8:.3f}x"]
    assert "where the step goes" not in bench.table(args, bench.foundation(args), [dataclasses.replace(base, compute_times=())])
    pooled = bench.pooled(args, bench.foundation(args), [base, base])
    assert pooled.compute_times == base.compute_times * 2


def test_a_cpu_run_of_the_train_app_times_each_steps_forward_backward(tmp_path, capsys):
    runs = tmp_path / "runs.jsonl"
    bench.main(["--device", "cpu", "--dtype", "fp32", "--model", "qwen3-moe-tiny", "--layers", "2", "--seq", "64",
                "--gpus", "1", "--microbatches", "2", "--steps", "3", "--warmup", "1", "--time-compute",
                "--save-runs", str(runs), "--variants", "baseline"])  # fmt: skip
    out = capsys.readouterr().out
    assert "forward-backward s by step" in out and "where the step goes" in out
    saved = bench.load_runs([runs])[1]["baseline"][0]
    assert len(saved.compute_times) == len(saved.step_times) == 2
    assert all(0 < c < t for c, t in zip(saved.compute_times, saved.step_times, strict=True))
