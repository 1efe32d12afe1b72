"""Which prompt a request's texts get, decided on the model load that runs them.

A prompt is prepended before tokenisation (``SentenceTransformer.encode(prompt_name=...)`` tokenises
``prompt + text``), so it must be the prompt of the slot the engine picked: a canary with other prompts encodes
with its own. The wire APIs say which prompt they want (``Prompt``: a name, Cohere's ``input_type``, or the
model's default) and admission resolves it against the running slot's description (core/slots.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import orjson

from inferd.core.description import ModelDescription
from inferd.core.errors import EngineError, Kind, excerpt

# Cohere's input types, and the prompt names each is looked up by (the first the model has), unless the
# operator's model.input_type_prompts names one.
INPUT_TYPE_PROMPTS: dict[str, tuple[str, ...]] = {
    "search_query": ("search_query", "query"),
    "search_document": ("search_document", "document", "passage", "corpus"),
    "classification": ("classification",),
    "clustering": ("clustering",),
}


@dataclass(frozen=True, slots=True)
class Prompt:
    """A request's prompt choice: ``name`` (None: the model's ``default_prompt_name``, as sentence-transformers
    does), or Cohere's ``input_type`` (then ``name`` is unused); ``field`` names the request field an unknown
    prompt is refused under."""

    name: str | None = None
    input_type: str | None = None
    field: str = "prompt_name"


def prompt_text(description: ModelDescription, choice: Prompt, input_type_prompts: Mapping[str, str]) -> str:
    """The text ``choice`` names on this model load.

    Cohere's ``input_type``: ``model.input_type_prompts`` (``input_type_prompts``) names a prompt per input type,
    else the first of INPUT_TYPE_PROMPTS' names the model has; an input type with no prompt encodes the text
    alone (it says what the text is, so the default prompt, made for another kind of text, is not applied).
    An unknown name is refused with the names there are, worded as text-embeddings-inference words it
    (``Available prompts: [...]``: its clients read the list from the message).
    """
    prompts = dict(description.prompts or {})
    name = choice.name
    if choice.input_type is not None:
        name = input_type_prompts.get(choice.input_type)
        if name is None:
            found = next((n for n in INPUT_TYPE_PROMPTS.get(choice.input_type, ()) if n in prompts), None)
            return prompts[found] if found is not None else ""
    if name is None:
        default = description.default_prompt_name
        return prompts.get(default, "") if default else ""
    if name not in prompts:
        if not prompts:
            raise _unknown(choice.field, f"{excerpt(name)!r} was asked, but this model has no prompts "
                           "(config_sentence_transformers.json)")
        raise _unknown(choice.field, f"{excerpt(name)!r} is not one of this model's prompts. Available prompts: "
                       f"{orjson.dumps(sorted(prompts)).decode()}")
    return prompts[name]


def _unknown(field: str, message: str) -> EngineError:
    return EngineError(Kind.INVALID_INPUT, message, "unknown_prompt", field=field)


