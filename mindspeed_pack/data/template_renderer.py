"""A chat template compiled once per worker and rendered many times, exactly as transformers renders it.

``--prompt-type hf`` renders every generation-prompt and full prefix of each conversation, so a
render's fixed costs dominate. transformers' ``render_jinja_template`` compiles the template in its
sandboxed environment (trim_blocks, lstrip_blocks, ``raise_exception``, ``tojson``,
``strftime_now``, ``{% generation %}``) and calls ``Template.render``; this module uses the same
compiled template and the same plain template data, and removes two per-render costs:

* ``Template.render`` merges the environment's globals into a new dict on every call; here the
  globals, special tokens and pinned kwargs are merged once (:func:`shared_variables`) and a
  render only adds the conversation (:func:`render`);
* the sandbox resolves ``message.role`` on a plain dict by trying the attribute first, failing
  with an AttributeError, then the item; :func:`_attribute_lookup` goes straight to the item
  when the name is no attribute of ``dict`` (the sandbox's own answer, without the exception),
  and reads the loop's counters directly. Everything else goes through the sandbox unchanged.

The template is compiled into an environment of its own, so transformers' cached one (used by
``apply_chat_template`` in the same process) is never modified. The tests compare every sample
with ``apply_chat_template``.
"""
from __future__ import annotations

import functools
from typing import Optional

_DICT_ATTRIBUTES = frozenset(dir(dict))
# LoopContext counters: ints and bools, which the sandbox always lets through
_LOOP_COUNTERS = frozenset(("first", "last", "index", "index0", "revindex", "revindex0", "length", "depth", "depth0"))


@functools.lru_cache(maxsize=None)
def transformers_steps() -> Optional[tuple]:
    """transformers' steps of ``render_jinja_template``: (plain template data, reasoning aliases, render with
    generation indices), or None where this version lacks them."""
    try:
        from transformers.utils.chat_template_utils import (_alias_reasoning_fields, _plain_template_data,
                                                            _render_with_assistant_indices)
    except ImportError:
        return None
    return _plain_template_data, _alias_reasoning_fields, _render_with_assistant_indices


def compile_template(source: str):
    """The template compiled in transformers' environment, in a copy of that environment of this caller's own."""
    from transformers.utils import chat_template_utils as ctu

    compile_fresh = getattr(ctu, "_cached_compile_jinja_template", None)
    if compile_fresh is None:  # only the shared cached environment: use it as it is
        return ctu._compile_jinja_template(source)
    template = compile_fresh(source)
    template.environment.getattr = _attribute_lookup(template.environment)
    return template


def _attribute_lookup(environment):
    """The sandbox's ``getattr``, answering the two common cases without its exception round trip."""
    from jinja2.runtime import LoopContext

    sandboxed, undefined = environment.getattr, environment.undefined

    def getattr_(obj, attribute):
        kind = type(obj)
        if kind is dict and attribute not in _DICT_ATTRIBUTES:
            try:
                return obj[attribute]
            except KeyError:
                return undefined(obj=obj, name=attribute)
        if kind is LoopContext and attribute in _LOOP_COUNTERS:
            return getattr(obj, attribute)
        return sandboxed(obj, attribute)

    return getattr_


def shared_variables(template, plain_kwargs: dict) -> dict:
    """What every render sees besides the conversation: the environment's globals (``raise_exception``,
    ``namespace``, ...) overridden by the special tokens and pinned kwargs, as ``Template.render`` merges them."""
    return {**template.globals, **plain_kwargs, "documents": None}


def render(template, variables: dict) -> str:
    """``template.render(**variables)`` for ``variables`` that already hold :func:`shared_variables`."""
    from jinja2.runtime import new_context

    context = new_context(template.environment, template.name, template.blocks, variables, True, None, None)
    return template.environment.concat(template.root_render_func(context))
