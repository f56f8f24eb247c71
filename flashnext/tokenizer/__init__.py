"""Tokenizer, chat templates and streaming detokenization."""

from flashnext.tokenizer.chat_template import ChatTemplateError, render_chat
from flashnext.tokenizer.detokenizer import IncrementalDetokenizer
from flashnext.tokenizer.tokenizer import Tokenizer

__all__ = ["ChatTemplateError", "IncrementalDetokenizer", "Tokenizer", "render_chat"]
