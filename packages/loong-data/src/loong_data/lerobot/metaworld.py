"""Metaworld (MuJoCo Sawyer tasks) as a LeRobot robot: one environment, its scripted expert, and
the observation -> (state, camera frame) view that the bundled dataset and policy rollouts share.

Needs the ``sim`` extra (metaworld, mujoco, gymnasium); rendering on CPU uses OSMesa (Debian
``libosmesa6``), chosen here unless ``MUJOCO_GL`` is already set.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

STATE_NAMES = ["hand_x", "hand_y", "hand_z", "gripper", "goal_x", "goal_y", "goal_z"]
ACTION_NAMES = ["dx", "dy", "dz", "grip"]
CAMERA = "observation.images.corner"


def _expert_class(task: str) -> type:
    """``reach-v3`` -> ``metaworld.policies.SawyerReachV3Policy``."""
    name = (
        "Sawyer"
        + "".join(p.capitalize() for p in task.split("-")[:-1])
        + task.split("-")[-1].upper()
        + "Policy"
    )
    policies = importlib.import_module("metaworld.policies")
    if not hasattr(policies, name):
        raise ValueError(f"metaworld task {task!r}: no scripted expert {name} in metaworld.policies")
    return getattr(policies, name)


@dataclass
class MetaworldEnv:
    """One Metaworld task rendered at ``size`` x ``size`` from the ``corner2`` camera."""

    task: str = "reach-v3"
    size: int = 64
    max_steps: int = 150

    def __post_init__(self) -> None:
        os.environ.setdefault("MUJOCO_GL", "osmesa")
        os.environ.setdefault("PYOPENGL_PLATFORM", os.environ["MUJOCO_GL"])
        import gymnasium as gym
        import metaworld  # noqa: F401  (registers the Meta-World/* environments)

        self.env = gym.make("Meta-World/MT1", env_name=self.task, render_mode="rgb_array", width=self.size,
                            height=self.size, camera_name="corner2", max_episode_steps=self.max_steps)  # fmt: skip
        self.expert = _expert_class(self.task)()
        self.obs: np.ndarray | None = None

    @property
    def instruction(self) -> str:
        return self.task.rsplit("-", 1)[0].replace("-", " ")

    def reset(self, seed: int) -> dict[str, Any]:
        self.obs, _ = self.env.reset(seed=seed)
        return self.observation()

    def observation(self) -> dict[str, Any]:
        """The state (hand position, gripper, goal) and the camera frame (uint8 HWC)."""
        state = np.concatenate([self.obs[:4], self.obs[36:39]]).astype(np.float32)
        return {"state": state, "image": np.ascontiguousarray(self.env.render()), "task": self.instruction}

    def expert_action(self) -> np.ndarray:
        return np.asarray(self.expert.get_action(self.obs), dtype=np.float32)

    def step(self, action: np.ndarray) -> tuple[dict[str, Any], bool, bool]:
        """Apply ``action``; returns the new observation, success, and whether the episode ended."""
        self.obs, _, terminated, truncated, info = self.env.step(np.clip(action, -1, 1))
        return self.observation(), bool(info["success"]), bool(terminated or truncated)

    def close(self) -> None:
        self.env.close()
