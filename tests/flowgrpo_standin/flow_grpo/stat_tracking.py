# A stand-in for Flow-GRPO's flow_grpo/stat_tracking.py: advantages per prompt,
# (reward - the prompt's mean) / (std + 1e-4), the std over every reward when global_std, else the prompt's.
import numpy as np


class PerPromptStatTracker:
    def __init__(self, global_std=False):
        self.global_std = global_std

    def update(self, prompts, rewards):
        prompts, rewards = np.array(prompts), np.asarray(rewards, dtype=np.float64)
        advantages = np.empty_like(rewards)
        for prompt in np.unique(prompts):
            mine = rewards[prompts == prompt]
            std = np.std(rewards) if self.global_std else np.std(mine)
            advantages[prompts == prompt] = (mine - np.mean(mine)) / (std + 1e-4)
        return advantages
