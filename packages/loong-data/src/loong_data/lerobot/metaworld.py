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
        from metaworld.env_dict import ALL_V3_ENVIRONMENTS

        if self.task not in ALL_V3_ENVIRONMENTS:
            raise ValueError(f"metaworld task {self.task!r}: not one of Metaworld's v3 environments")
        # The task's own class, its goal observable and drawn at each reset from the generator the
        # reset seed sets (as metaworld's goal-observable variants, minus their frozen goal). The
        # MT1 benchmark instead picks one of 50 goals drawn when it is built, with a generator the
        # reset seed does not reach: its goals differ between processes for the same seed.
        env = ALL_V3_ENVIRONMENTS[self.task](render_mode="rgb_array", camera_name="corner2", width=self.size,
                                             height=self.size)  # fmt: skip
        env._partially_observable, env._freeze_rand_vec, env.seeded_rand_vec = False, False, True
        env._set_task_called = True
        del env.sawyer_observation_space  # cached with the goal hidden (steps clip to it): recomputed
        self.env = env
        self.expert = _expert_class(self.task)()
        self.obs: np.ndarray | None = None
        self.steps = 0

    @property
    def instruction(self) -> str:
        return self.task.rsplit("-", 1)[0].replace("-", " ")

    def reset(self, seed: int, render: bool = True) -> dict[str, Any]:
        self.env.seed(seed)
        self.obs, _ = self.env.reset()
        self.steps = 0
        return self.observation(render)

    def observation(self, render: bool = True) -> dict[str, Any]:
        """The state (hand position, gripper, goal) and the camera frame (uint8 HWC; None when not
        ``render``: software rendering costs far more than a physics step, so rollouts render
        only the frames a policy looks at)."""
        state = np.concatenate([self.obs[:4], self.obs[36:39]]).astype(np.float32)
        image = np.ascontiguousarray(self.env.render()) if render else None
        return {"state": state, "image": image, "task": self.instruction}

    def expert_action(self) -> np.ndarray:
        return np.asarray(self.expert.get_action(self.obs), dtype=np.float32)

    def step(self, action: np.ndarray, render: bool = True) -> tuple[dict[str, Any], bool, bool]:
        """Apply ``action``; returns the new observation, success, and whether the episode ended."""
        self.obs, _, terminated, truncated, info = self.env.step(np.clip(action, -1, 1))
        self.steps += 1
        done = terminated or truncated or self.steps >= self.max_steps
        return self.observation(render), bool(info["success"]), bool(done)

    def close(self) -> None:
        self.env.close()
