"""The coding agent the agentic benchmark imitates: its system prompt and its 10 tool schemas.

Modelled on what coding agents send (long descriptions, nested parameters), because the size and shape of
this prefix is what the prefix cache must keep across a session.
"""
from __future__ import annotations


def _tool(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties, "required": required,
                       "additionalProperties": False}}}


def _s(description: str) -> dict:
    return {"type": "string", "description": description}


def _i(description: str) -> dict:
    return {"type": "integer", "description": description}


TOOLS: list[dict] = [
    _tool("read", "Read a file from the local filesystem. The path must be absolute or relative to the "
          "workspace root. By default up to 2000 lines are returned from the start of the file; use offset "
          "and limit for long files. Lines are numbered starting at 1, in the format `number<TAB>text`. "
          "Lines longer than 2000 characters are truncated. Reading a directory is an error: use ls.",
          {"path": _s("The file to read."), "offset": _i("The line to start reading at (1-based)."),
           "limit": _i("The number of lines to read.")}, ["path"]),
    _tool("bash", "Run a shell command in a persistent bash session with a timeout. Use it for builds, "
          "tests, git and package managers, not for reading or searching files (use read, grep and ls). "
          "Quote paths that contain spaces. The output is truncated to 30000 characters; the exit status "
          "is reported on the last line. Commands that wait for input will time out.",
          {"command": _s("The command to run."), "timeout": _i("Timeout in milliseconds, at most 600000."),
           "description": _s("Five to ten words saying what the command does.")}, ["command"]),
    _tool("edit", "Replace an exact string in a file. old_string must occur exactly once unless "
          "replace_all is set; include enough surrounding lines to make it unique. Preserve the file's "
          "indentation exactly. Read the file first: editing a file you have not read fails.",
          {"path": _s("The file to modify."), "old_string": _s("The text to replace."),
           "new_string": _s("The text to put in its place (must differ from old_string)."),
           "replace_all": {"type": "boolean", "description": "Replace every occurrence."}},
          ["path", "old_string", "new_string"]),
    _tool("write", "Write a file, replacing it if it exists. Prefer edit for changes to existing files; "
          "never create documentation files unless asked.",
          {"path": _s("The file to write."), "content": _s("The full content of the file.")}, ["path", "content"]),
    _tool("grep", "Search file contents with a regular expression (ripgrep syntax). Returns matching lines "
          "as path:line:text, sorted by modification time. Filter files with glob or type; use "
          "output_mode files_with_matches to list paths only.",
          {"pattern": _s("The regular expression."), "path": _s("Directory or file to search in."),
           "glob": _s("Glob that files must match, e.g. *.py."),
           "output_mode": {"type": "string", "enum": ["content", "files_with_matches", "count"]},
           "context": _i("Lines of context around each match.")}, ["pattern"]),
    _tool("ls", "List the files and directories in a directory, with sizes. Ignores .git and files named "
          "by ignore globs.",
          {"path": _s("The directory to list."), "ignore": {"type": "array", "items": {"type": "string"},
                                                          "description": "Globs to leave out."}}, ["path"]),
    _tool("todo_read", "Read the current session's todo list with each item's status and priority. "
          "Use it often to keep track of the task.", {}, []),
    _tool("todo_write", "Replace the session's todo list. Mark an item in_progress before starting it and "
          "completed as soon as it is done; only one item may be in_progress.",
          {"todos": {"type": "array", "description": "The whole list.", "items": {
              "type": "object", "required": ["id", "content", "status"], "properties": {
                  "id": _s("Stable identifier."), "content": _s("What to do."),
                  "status": {"type": "string", "enum": ["pending", "in_progress", "completed"]},
                  "priority": {"type": "string", "enum": ["high", "medium", "low"]}}}}}, ["todos"]),
    _tool("web_search", "Search the web and return the top results with title, URL and snippet. Use for "
          "information newer than your training or documentation of third-party libraries.",
          {"query": _s("The search query."), "max_results": _i("How many results, at most 10."),
           "allowed_domains": {"type": "array", "items": {"type": "string"}}}, ["query"]),
    _tool("web_fetch", "Fetch a URL and return its content converted to markdown. HTTP is upgraded to "
          "HTTPS; pages over 100 KB are truncated. Redirects to another host are reported, not followed.",
          {"url": _s("The URL to fetch."), "prompt": _s("What to look for in the page.")}, ["url"]),
]

SYSTEM_PROMPT = """You are a coding agent working in the user's repository through tools. You read before \
you change, you run the tests after you change, and you keep the todo list current.

# How to work
- Understand the request first. Search the code base with grep and ls, read the files that matter, and \
only then plan. Use todo_write to break any task of three steps or more into items.
- Make the smallest change that solves the problem and matches the surrounding style: naming, typing, \
error handling, imports. Never add a dependency without checking that the project already uses it.
- After a change, run the narrowest test that covers it, then the wider suite. If a test fails, read the \
failure, find the cause, and fix the cause rather than the test.
- Never commit, push or rewrite history unless the user asks. Never print or log secrets.

# Tools
- Call exactly one tool per turn. Paths are relative to the workspace root /workspace/ledgerline.
- Prefer read, grep and ls over bash for looking at files; use bash for tests, builds and git.
- Tool results can be long and are truncated; ask for a range with offset and limit when you need more.
- When a tool fails, read the error: a wrong path or a non-unique edit string is your mistake to fix.

# Style of answers
Be brief. Explain what you changed and why in a few sentences once the task is done; do not narrate each \
step. Refer to code as path:line so the user can jump to it.

# Environment
Working directory: /workspace/ledgerline. Platform: linux. Python 3.11, pytest 8, ruff. The project is \
a small double-entry bookkeeping service with a REST API (FastAPI), a SQLite store and a CLI."""

USER_TASK = ("The /accounts/{id}/entries endpoint skips one entry between pages when the client follows the "
             "next_cursor link, and tests/test_pagination.py::test_cursor_roundtrip fails since last week. "
             "Find the cause, fix it, make sure the whole test suite passes, and tell me what went wrong.")
