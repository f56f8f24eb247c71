"""Tokenizer, chat templates and streaming detokenization."""

from flashnext.tokenizer.chat_template import ChatTemplateError, render_chat
from flashnext.tokenizer.detokenizer import IncrementalDetokenizer
from flashnext.tokenizer.tokenizer import InvalidText, Tokenizer

__all__ = ["ChatTemplateError", "IncrementalDetokenizer", "InvalidText", "Tokenizer", "render_chat"]
