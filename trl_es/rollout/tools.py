"""Calling the tools of agent episodes safely: a `SystemExit` stays a failed call (`no_exit`, from
`trl_es.rollout.environments`), a call that does not answer within `tool_call_timeout` is a `ToolTimeout`, and tool
calls nested too deep for Python's recursion limit stay text (`nesting`)."""

from __future__ import annotations

import threading
from collections.abc import Callable

from .environments import no_exit


MAX_NESTING = 100
"""The deepest lists and dicts a completion's tool calls may nest: deeper ones stay text (parsing, copying or
rendering them would exhaust Python's recursion limit)."""


async def exit_guarded(coroutine, what: str):
    """`coroutine`'s result, a `SystemExit` in it raised as `no_exit` raises it (on the event loop, a SystemExit
    would stop the loop itself)."""
    with no_exit(what):
        return await coroutine


TOOL_TEMPLATE_HINT = (
    "set a tool-capable chat template on the tokenizer (processing_class), e.g. TRL's Qwen2.5 template: "
    "tokenizer.chat_template = open(os.path.join(os.path.dirname(trl.__file__), 'chat_templates', "
    "'qwen2_5.jinja')).read()"
)


class ToolTimeout(TimeoutError):
    """A tool call that did not answer within `tool_call_timeout`."""

    def __init__(self, name: str, timeout: float):
        super().__init__(f"tool {name} did not answer within tool_call_timeout={timeout} s")


def nesting(value) -> int:
    """How deep lists and dicts nest in `value` (0: neither), counted without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, (list, tuple)):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in item)
    return deepest


def call_with_timeout(tool: Callable, arguments: dict, timeout: float, name: str):
    """`tool(**arguments)` in a daemon thread, waited for `timeout` seconds: a `ToolTimeout` after that (the call
    itself keeps running in the background: Python cannot stop a thread)."""
    outcome = {}

    def target():
        try:
            outcome["result"] = tool(**arguments)
        except BaseException as error:  # re-raised in the caller's thread
            outcome["error"] = error

    thread = threading.Thread(target=target, daemon=True, name=f"trl-es-tool-{name}")
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise ToolTimeout(name, timeout)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]
