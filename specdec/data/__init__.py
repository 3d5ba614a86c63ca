"""Prompt datasets: JSONL files of prompts (the built-in held-out set, Spec-Bench, your own), and chat templates."""

from specdec.data.chat import ChatTemplate, ChatTemplateError, conversation_prompt, load_chat_template
from specdec.data.prompts import DataConfig, Prompt, PromptDataError, load_prompts

__all__ = [
    "ChatTemplate",
    "ChatTemplateError",
    "DataConfig",
    "Prompt",
    "PromptDataError",
    "conversation_prompt",
    "load_chat_template",
    "load_prompts",
]
