"""Build the bundled robot dataset: scripted-expert Metaworld episodes, rendered with MuJoCo and
written as a LeRobot v3.0 dataset (deterministic: episode e is reset with seed ``seed + e``).

    MUJOCO_GL=osmesa uv run python -m loong_data.tools.build_metaworld_sample \\
        --out packages/loong-data/src/loong_data/corpus/metaworld_reach --task reach-v3 --episodes 40

Each episode runs the expert until the task succeeds, then ``--hold`` more steps (the policy
learns to stay), at most ``--max-steps``.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import numpy as np

from loong_data.lerobot.metaworld import ACTION_NAMES, CAMERA, STATE_NAMES, MetaworldEnv
from loong_data.lerobot.writer import LeRobotWriter


def record_episode(env: MetaworldEnv, seed: int, hold: int) -> dict[str, np.ndarray] | None:
    obs = env.reset(seed)
    states, actions, frames, left = [], [], [], None
    for _ in range(env.max_steps):
        action = env.expert_action()
        states.append(obs["state"]), actions.append(action), frames.append(obs["image"])
        obs, success, done = env.step(action)
        left = hold if success and left is None else left
        if left is not None:
            left -= 1
            if left < 0:
                break
        if done:
            break
    if left is None:  # the expert failed: leave the episode out
        return None
    return {"state": np.stack(states), "action": np.stack(actions), "frames": np.stack(frames)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--task", action="append", help="Metaworld task (repeatable); default reach-v3")
    p.add_argument("--episodes", type=int, default=40, help="per task")
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--hold", type=int, default=5)
    p.add_argument("--max-steps", type=int, default=150)
    p.add_argument("--seed", type=int, default=1000)
    p.add_argument("--version", default="v3.0", choices=["v3.0", "v2.1"])
    args = p.parse_args(argv)
    if args.out.exists():
        shutil.rmtree(args.out)
    writer = LeRobotWriter(args.out, fps=80, state_names=STATE_NAMES, action_names=ACTION_NAMES,
                           cameras={CAMERA: (args.size, args.size)}, robot_type="sawyer", version=args.version)  # fmt: skip
    for task in args.task or ["reach-v3"]:
        env = MetaworldEnv(task, size=args.size, max_steps=args.max_steps)
        kept = 0
        for e in range(args.episodes):
            ep = record_episode(env, args.seed + e, args.hold)
            if ep is not None:
                writer.add_episode(ep["state"], ep["action"], {CAMERA: ep["frames"]}, env.instruction)
                kept += 1
        print(f"{task}: {kept}/{args.episodes} expert episodes succeeded")
        env.close()
    print(f"wrote {writer.finish()}")


if __name__ == "__main__":
    main()
