"""Roll a trained Pi0.5 policy out in the Metaworld simulator and report its success rate, next
to a random policy's on the same episodes (same reset seeds):

    MUJOCO_GL=osmesa uv run python bench/pi05_rollout.py runs/pi05/checkpoints/step_00000300 --episodes 10

The policy sees what the bundled dataset recorded (state, the 64x64 corner camera, the task),
predicts an action chunk with its cached Euler sampler, and executes the first
``--action-steps`` actions before observing again. Seeds start past the dataset's (1000 + 24) so
that the episodes are unseen goals. Needs the ``sim`` extra and OSMesa (Debian libosmesa6).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from loong_ckpt.pi05 import read_checkpoint_weights
from loong_data.bundled import default_robot_dataset, default_tokenizer
from loong_data.lerobot import LeRobotDataset, Pi05BatchConfig, Pi05Batcher
from loong_data.lerobot.metaworld import CAMERA, MetaworldEnv
from loong_models.embodied import Pi05Policy


def load_policy(checkpoint: str | Path) -> Pi05Policy:
    weights, cfg = read_checkpoint_weights(checkpoint)
    policy = Pi05Policy(cfg).eval()
    policy.load_state_dict(weights)
    return policy


def rollout(env: MetaworldEnv, seed: int, act) -> bool:
    """One episode; ``act(observation) -> actions [n, 4]`` executed in order. Success as Metaworld says."""
    obs = env.reset(seed)
    for _ in range(env.max_steps):
        for action in act(obs):
            obs, success, done = env.step(action)
            if success:
                return True
            if done:
                return False
    return False


def policy_actor(policy: Pi05Policy, batcher: Pi05Batcher, steps: int, generator: torch.Generator):
    def act(obs: dict) -> np.ndarray:
        batch = batcher.policy_inputs(obs["state"][None], [{CAMERA: obs["image"]}], [obs["task"]])
        cfg = policy.cfg
        noise = torch.randn(1, cfg.chunk_size, cfg.max_action_dim, generator=generator)
        return batcher.unnormalise_actions(policy.sample_actions(batch, noise=noise))[0, :steps]

    return act


def random_actor(rng: np.random.Generator, steps: int):
    return lambda obs: rng.uniform(-1, 1, size=(steps, 4)).astype(np.float32)


def evaluate(checkpoint: str | Path, *, episodes: int, action_steps: int, first_seed: int = 1024,
             max_steps: int = 150) -> dict:  # fmt: skip
    policy = load_policy(checkpoint)
    cfg = policy.cfg
    ds = LeRobotDataset(default_robot_dataset(), horizon=cfg.chunk_size)
    batcher = Pi05Batcher(ds, default_tokenizer(), Pi05BatchConfig(cfg.vision.image_size, cfg.max_state_dim,
                                                                   cfg.max_action_dim, cfg.tokenizer_max_length))  # fmt: skip
    env = MetaworldEnv("reach-v3", size=ds.meta.features[CAMERA]["shape"][0], max_steps=max_steps)
    seeds = range(first_seed, first_seed + episodes)
    ours = policy_actor(policy, batcher, action_steps, torch.Generator().manual_seed(0))
    rand = random_actor(np.random.default_rng(0), action_steps)
    policy_ok = [rollout(env, s, ours) for s in seeds]
    random_ok = [rollout(env, s, rand) for s in seeds]
    env.close()
    return {"episodes": episodes, "policy_success_rate": float(np.mean(policy_ok)),
            "random_success_rate": float(np.mean(random_ok))}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint")
    p.add_argument("--episodes", type=int, default=10)
    p.add_argument("--action-steps", type=int, default=5, help="actions executed per prediction")
    p.add_argument("--max-steps", type=int, default=150)
    args = p.parse_args()
    print(json.dumps(evaluate(args.checkpoint, episodes=args.episodes, action_steps=args.action_steps,
                              max_steps=args.max_steps)))  # fmt: skip


if __name__ == "__main__":
    main()
