"""Prompt datasets: JSONL files of prompts (the built-in held-out set, Spec-Bench, your own)."""

from specdec.data.prompts import DataConfig, Prompt, PromptDataError, load_prompts

__all__ = ["DataConfig", "Prompt", "PromptDataError", "load_prompts"]
