"""LeRobot datasets: the writer and reader round-trip v3.0 and v2.1, action chunks stop at the
episode's end, stats and normalisation, errors that name the file."""

import json

import numpy as np
import pytest
import torch

from loong_data.lerobot import (
    LeRobotDataset,
    LeRobotWriter,
    Normalizer,
    discretise_state,
    read_meta,
    state_prompt,
)

CAM = "observation.images.top"


def episodes(seed: int = 0):
    rng = np.random.default_rng(seed)
    out = []
    for e, n in enumerate((5, 8, 3)):
        out.append(dict(state=rng.normal(size=(n, 3)).astype(np.float32), action=rng.normal(size=(n, 2)).astype(np.float32),
                        images={CAM: rng.integers(0, 255, size=(n, 8, 8, 3), dtype=np.uint8)},
                        task="reach" if e != 1 else "push"))  # fmt: skip
    return out


def write(root, version):
    w = LeRobotWriter(root, fps=10, state_names=["a", "b", "c"], action_names=["x", "y"], cameras={CAM: (8, 8)},
                      version=version)  # fmt: skip
    for ep in episodes():
        w.add_episode(**ep)
    return w.finish()


@pytest.mark.parametrize("version", ["v3.0", "v2.1"])
def test_writer_and_reader_round_trip(tmp_path, version):
    ds = LeRobotDataset(write(tmp_path / version, version), horizon=4)
    eps = episodes()
    assert ds.meta.version == version and len(ds) == 16 and ds.meta.tasks == ["reach", "push"]
    assert [e.length for e in ds.meta.episodes] == [5, 8, 3]
    frame = ds[5 + 2]  # episode 1, frame 2
    np.testing.assert_array_equal(frame["state"], eps[1]["state"][2])
    np.testing.assert_array_equal(frame["images"][CAM], eps[1]["images"][CAM][2])
    np.testing.assert_array_equal(frame["actions"], eps[1]["action"][2:6])
    assert frame["task"] == "push" and frame["episode_index"] == 1 and frame["frame_index"] == 2


def test_action_chunks_repeat_the_last_action_past_the_episode_end(tmp_path):
    ds = LeRobotDataset(write(tmp_path / "d", "v3.0"), horizon=4)
    frame = ds[3]  # episode 0 has 5 frames: frames 3, 4, then two pads
    last = episodes()[0]["action"]
    np.testing.assert_array_equal(frame["actions"], last[[3, 4, 4, 4]])
    assert frame["action_is_pad"].tolist() == [False, False, True, True]


def test_v21_stats_aggregate_to_the_v30_stats(tmp_path):
    s3, s2 = read_meta(write(tmp_path / "a", "v3.0")).stats, read_meta(write(tmp_path / "b", "v2.1")).stats
    for key in ("observation.state", "action", CAM):
        for stat in ("min", "max", "mean", "std", "count"):
            np.testing.assert_allclose(
                s2[key][stat], s3[key][stat], rtol=1e-6, atol=1e-9, err_msg=f"{key}.{stat}"
            )


def test_quantile_normalisation_maps_q01_q99_to_minus_one_one():
    norm = Normalizer({"q01": np.array([0.0, -2.0]), "q99": np.array([2.0, 2.0])}, "quantiles")
    np.testing.assert_allclose(norm(np.array([[0.0, -2.0], [2.0, 2.0]])), [[-1, -1], [1, 1]], atol=1e-6)
    np.testing.assert_allclose(norm.inverse(norm(np.array([0.5, 1.0]))), [0.5, 1.0], atol=1e-6)
    with pytest.raises(ValueError, match="allowed: mean_std, min_max, quantiles"):
        Normalizer({}, "zscore")


def test_state_prompt_discretises_into_256_bins_as_openpi():
    assert discretise_state(np.array([-1.0, 0.0, 0.999])).tolist() == [0, 128, 255]
    assert (
        state_prompt("reach_the goal", np.array([-1.0, 0.0]))
        == "Task: reach the goal, State: 0 128;\nAction: "
    )


def test_a_bad_dataset_is_named(tmp_path):
    root = write(tmp_path / "d", "v3.0")
    info = json.loads((root / "meta/info.json").read_text())
    (root / "meta/info.json").write_text(json.dumps(dict(info, codebase_version="v1.6")))
    with pytest.raises(ValueError, match=r"d/meta/info.json: codebase_version='v1.6'; supported: v2.1, v3.0"):
        read_meta(root)
    with pytest.raises(FileNotFoundError, match="nowhere/meta/info.json: missing"):
        read_meta(tmp_path / "nowhere")
    (root / "meta/info.json").write_text(json.dumps(info))
    with pytest.raises(KeyError, match="no feature 'observation.joints'"):
        LeRobotDataset(root, horizon=2, state_key="observation.joints")


def test_pi05_batches_normalise_pad_and_tokenise_the_prompt(tmp_path):
    from loong_data.bundled import default_tokenizer
    from loong_data.lerobot import Pi05BatchConfig, Pi05Batcher

    ds = LeRobotDataset(write(tmp_path / "d", "v3.0"), horizon=4)
    batcher = Pi05Batcher(
        ds,
        default_tokenizer(),
        Pi05BatchConfig(image_size=16, max_state_dim=8, max_action_dim=6, max_length=40),
    )
    b = batcher.collate([0, 6, 15])
    assert b["images"].shape == (3, 1, 3, 16, 16) and b["images"].min() >= -1 and b["images"].max() <= 1
    assert b["actions"].shape == (3, 4, 6) and not b["actions"][..., 2:].any()
    assert b["action_dim_mask"].tolist() == [True, True, False, False, False, False]
    prompt = batcher.tokenizer.decode(b["tokens"][1][b["token_mask"][1]].tolist())
    assert prompt.startswith("Task: push, State: ") and prompt.endswith(";\nAction: ")
    np.testing.assert_allclose(batcher.unnormalise_actions(b["actions"]), np.stack([ds[i]["actions"] for i in (0, 6, 15)]),
                               rtol=1e-5, atol=1e-5)  # fmt: skip


def test_dp_ranks_split_the_single_process_batches_and_resume_mid_run(tmp_path):
    from loong_data.bundled import default_tokenizer
    from loong_data.lerobot import Pi05BatchConfig, Pi05Batcher, rank_batches

    ds = LeRobotDataset(write(tmp_path / "d", "v3.0"), horizon=2)
    batcher = Pi05Batcher(
        ds,
        default_tokenizer(),
        Pi05BatchConfig(image_size=8, max_state_dim=4, max_action_dim=2, max_length=32),
    )
    kw = dict(micro_batch_size=2, seed=3)
    one = rank_batches(batcher, num_microbatches=2, dp_rank=0, dp_size=1, **kw)
    ranks = [rank_batches(batcher, num_microbatches=1, dp_rank=r, dp_size=2, **kw) for r in (0, 1)]
    resumed = rank_batches(batcher, num_microbatches=2, dp_rank=0, dp_size=1, start_step=2, **kw)
    steps = [next(one) for _ in range(3)]
    for step in steps[:2]:
        split = [next(it)[0] for it in ranks]
        assert all(torch.equal(step[r]["actions"], split[r]["actions"]) for r in (0, 1))
    assert all(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(steps[2], next(resumed)))
