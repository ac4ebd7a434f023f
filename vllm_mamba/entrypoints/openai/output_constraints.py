"""The request fields that constrain what may be generated, and their engine parameters.

Structured outputs can be asked for in three ways, as with vLLM: OpenAI's `response_format`
(`{"type": "json_object"}` or `{"type": "json_schema", "json_schema": {"schema": ...}}`),
vLLM's `structured_outputs` (`{"json" | "regex" | "choice" | "grammar": ...}`), and vLLM's
legacy `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`. At most one may be
set in a request; the field that was used is remembered so that a spec the grammar library
cannot compile (or not within `--grammar-compile-timeout`) is a 400 naming it. The server
compiles in the engine's grammar processes (`compile_structured`), so a slow grammar holds up
neither the tokenizer thread nor the engine's steps.
`logit_bias` keys are token ids written as strings (JSON object keys).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from vllm_mamba.engine.structured_outputs import StructuredOutputError
from vllm_mamba.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from vllm_mamba.engine.async_engine import AsyncLLMEngine

_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


class JsonSchemaSpec(BaseModel):
    """`response_format.json_schema`: OpenAI's named schema (`strict` is accepted; the
    output always follows the schema)."""

    name: str = "response"
    description: str | None = None
    # `schema` shadows a BaseModel attribute, hence the alias.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(populate_by_name=True)


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class StructuredOutputsRequest(BaseModel):
    """vLLM's `structured_outputs` request field: exactly one of its members."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


@dataclass
class StructuredSource:
    """The structured-outputs parameters of a request and the field they came from."""

    params: StructuredOutputsParams
    field: str


class ConstraintError(ValueError):
    """A constraint field that is malformed; `field` names it."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


def structured_source(req: Any) -> StructuredSource | None:
    """The one structured-outputs request of `req` (a `SamplingRequest`), if any.

    Raises:
        ConstraintError: more than one kind set, or a member malformed.
    """
    found: list[tuple[str, dict[str, Any]]] = []
    fmt: ResponseFormat | None = req.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise ConstraintError(
                "response_format: type json_schema needs json_schema.schema", "response_format"
            )
        found.append(("response_format", {"json": fmt.json_schema.json_schema}))
    if req.structured_outputs is not None:
        spec = req.structured_outputs.model_dump(by_alias=True, exclude_none=True)
        found.append(("structured_outputs", spec))
    for name, kind in _GUIDED.items():
        value = getattr(req, name)
        if value is not None:
            found.append((name, {kind: value}))
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise ConstraintError(
            f"only one kind of structured output may be requested, got {names}", found[1][0]
        )
    field, spec = found[0]
    try:
        params = StructuredOutputsParams(**spec)
    except ValueError as err:
        message = str(err).replace("SamplingParams.structured_outputs", field)
        raise ConstraintError(message, field) from err
    return StructuredSource(params, field)


def logit_bias_ids(bias: dict[str, float] | None) -> dict[int, float] | None:
    """`logit_bias` with its keys as token ids.

    Raises:
        ConstraintError: a key that is not an integer.
    """
    if bias is None:
        return None
    try:
        return {int(key): value for key, value in bias.items()}
    except ValueError as err:
        raise ConstraintError(
            "logit_bias keys must be token ids (integers written as strings)", "logit_bias"
        ) from err


async def compile_structured(engine: AsyncLLMEngine, source: StructuredSource | None) -> None:
    """Compiles a request's grammar in the engine's grammar pool, into its cache.

    Raises:
        ConstraintError: the grammar library cannot compile it (naming the request field).
    """
    if source is None:
        return
    try:
        await engine.compile_grammar(source.params)
    except StructuredOutputError as err:
        raise ConstraintError(f"{source.field}: {err.why}", source.field) from err
