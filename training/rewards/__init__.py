"""Reward functions: built-ins, user functions by import path, and text reward models."""

from .registry import Reward, RewardBatch, RewardError, UnknownRewardError, resolve_reward, reward_docs, score

__all__ = ["Reward", "RewardBatch", "RewardError", "UnknownRewardError", "resolve_reward", "reward_docs", "score"]
