"""Pi0.5's prompt: the task and the robot state, the state discretised into bins as text."""

from __future__ import annotations

import numpy as np


def discretise_state(state: np.ndarray, bins: int = 256) -> np.ndarray:
    """Normalised state in [-1, 1] -> bin indices 0..bins-1 (OpenPI's ``PaligemmaTokenizer``)."""
    return np.digitize(state, bins=np.linspace(-1, 1, bins + 1)[:-1]) - 1


def state_prompt(task: str, state: np.ndarray, bins: int = 256) -> str:
    """``Task: <task>, State: <bins>;\\nAction: `` as LeRobot's Pi0.5 processor writes it."""
    cleaned = task.strip().replace("_", " ").replace("\n", " ")
    digits = " ".join(map(str, discretise_state(np.asarray(state), bins)))
    return f"Task: {cleaned}, State: {digits};\nAction: "
