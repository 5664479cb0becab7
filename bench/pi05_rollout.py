"""Roll a trained Pi0.5 policy out in the Metaworld simulator and report its success rate, next
to a random policy's and a constant mean-action policy's on the same episodes (same reset seeds):

    uv run train --config-name pi05-reach
    MUJOCO_GL=osmesa uv run python bench/pi05_rollout.py runs/pi05-reach/checkpoints/step_00000500 --episodes 20

The policy sees what the bundled dataset recorded (state, the 64x64 corner camera, the task),
predicts an action chunk with its cached Euler sampler, and executes the first
``--action-steps`` actions before observing again. Each reset seed fixes the episode's goal
(drawn in reach's goal box; see ``MetaworldEnv``), the same for the three policies; the seeds start
past the dataset's (1000 + 24), and none of the goals is a recorded episode's. The mean-action policy repeats the dataset's mean action:
it tells how far plain drift towards the goal region gets (reach-v3's goals lie ahead of the
hand), so a policy that only learnt the average motion does not pass for one that reads the
goal. Needs the ``sim`` extra and a GL backend (OSMesa on CPU: Debian libosmesa6); only the
frames the policy looks at are rendered (software rendering costs far more than physics).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from loong_ckpt.pi05 import read_checkpoint_weights
from loong_data.bundled import default_robot_dataset, default_tokenizer
from loong_data.lerobot import LeRobotDataset, Pi05BatchConfig, Pi05Batcher
from loong_data.lerobot.metaworld import CAMERA, MetaworldEnv
from loong_models.embodied import Pi05Policy

Actor = Callable[[dict], np.ndarray]  # observation -> actions [n, 4], executed in order


def load_policy(checkpoint: str | Path) -> Pi05Policy:
    weights, cfg = read_checkpoint_weights(checkpoint)
    policy = Pi05Policy(cfg).eval()
    policy.load_state_dict(weights)
    return policy


def rollout(env: MetaworldEnv, seed: int, act: Actor, render: bool = True) -> bool:
    """One episode; success as Metaworld says. With ``render`` the frame is rendered only after
    the last action of each chunk (the observation ``act`` sees next)."""
    obs = env.reset(seed, render)
    for _ in range(env.max_steps):
        actions = act(obs)
        for i, action in enumerate(actions):
            obs, success, done = env.step(action, render=render and i == len(actions) - 1)
            if success:
                return True
            if done:
                return False
    return False


def batcher_for(policy: Pi05Policy, root: str | Path | None = None) -> Pi05Batcher:
    """The training data path's view of a live observation (the dataset's stats and cameras)."""
    cfg = policy.cfg
    ds = LeRobotDataset(root or default_robot_dataset(), horizon=cfg.chunk_size)
    return Pi05Batcher(ds, default_tokenizer(), Pi05BatchConfig(cfg.vision.image_size, cfg.max_state_dim,
                                                                cfg.max_action_dim, cfg.tokenizer_max_length))  # fmt: skip


def policy_actor(policy: Pi05Policy, batcher: Pi05Batcher, steps: int, generator: torch.Generator) -> Actor:
    def act(obs: dict) -> np.ndarray:
        batch = batcher.policy_inputs(obs["state"][None], [{CAMERA: obs["image"]}], [obs["task"]])
        cfg = policy.cfg
        noise = torch.randn(1, cfg.chunk_size, cfg.max_action_dim, generator=generator)
        return batcher.unnormalise_actions(policy.sample_actions(batch, noise=noise))[0, :steps]

    return act


def random_actor(rng: np.random.Generator, steps: int) -> Actor:
    return lambda obs: rng.uniform(-1, 1, size=(steps, 4)).astype(np.float32)


def mean_actor(batcher: Pi05Batcher, steps: int) -> Actor:
    mean = batcher.ds.columns[batcher.ds.action_key].mean(0)
    return lambda obs: np.repeat(mean[None], steps, axis=0)


def evaluate(policy: Pi05Policy, batcher: Pi05Batcher, *, episodes: int, action_steps: int, first_seed: int = 1024,
             max_steps: int = 150, task: str = "reach-v3", seed: int = 0) -> dict:  # fmt: skip
    """Success rates over ``episodes`` reset seeds from ``first_seed``: the policy, a random
    policy, the mean-action policy; and the policy's successful seeds."""
    env = MetaworldEnv(task, size=batcher.ds.meta.features[CAMERA]["shape"][0], max_steps=max_steps)
    seeds = range(first_seed, first_seed + episodes)
    ours = policy_actor(policy, batcher, action_steps, torch.Generator().manual_seed(seed))
    policy_ok = [rollout(env, s, ours) for s in seeds]
    rand = random_actor(np.random.default_rng(seed), action_steps)
    random_ok = [rollout(env, s, rand, render=False) for s in seeds]
    mean_ok = [rollout(env, s, mean_actor(batcher, action_steps), render=False) for s in seeds]
    env.close()
    return {"task": task, "episodes": episodes, "seeds": [first_seed, first_seed + episodes - 1],
            "policy_success_rate": float(np.mean(policy_ok)), "random_success_rate": float(np.mean(random_ok)),
            "mean_action_success_rate": float(np.mean(mean_ok)),
            "policy_successes": [s for s, ok in zip(seeds, policy_ok) if ok]}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint")
    p.add_argument("--episodes", type=int, default=20)
    p.add_argument("--action-steps", type=int, default=5, help="actions executed per prediction")
    p.add_argument("--max-steps", type=int, default=150)
    p.add_argument("--first-seed", type=int, default=1024, help="reset seed of the first episode")
    p.add_argument("--seed", type=int, default=0, help="the policy's noise and the random policy's draws")
    p.add_argument(
        "--dataset", help="the LeRobot dataset the policy was trained on (stats); default: the bundled one"
    )
    args = p.parse_args()
    torch.manual_seed(args.seed)
    policy = load_policy(args.checkpoint)
    figures = evaluate(policy, batcher_for(policy, args.dataset), episodes=args.episodes, action_steps=args.action_steps,
                       first_seed=args.first_seed, max_steps=args.max_steps, seed=args.seed)  # fmt: skip
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
