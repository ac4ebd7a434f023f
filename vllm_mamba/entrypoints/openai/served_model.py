"""The model a server serves: its public names, its model cards, and the check that a request
names it (404 otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_mamba.entrypoints.openai.errors import APIError
from vllm_mamba.entrypoints.openai.protocol import ModelCard, ModelList


@dataclass
class ServedModel:
    """The served model.

    Args:
        names: the names clients may use; the first is the main one.
        root: what was loaded (a directory or hub id).
        max_model_len: the longest prompt plus output.
    """

    names: list[str]
    root: str
    max_model_len: int
    cards: list[ModelCard] = field(init=False)

    def __post_init__(self) -> None:
        self.cards = [
            ModelCard(id=name, root=self.root, max_model_len=self.max_model_len)
            for name in self.names
        ]

    @property
    def name(self) -> str:
        """The main name."""
        return self.names[0]

    def resolve(self, requested: str | None) -> str:
        """The name to answer with; the main one when the request names none.

        Raises:
            APIError: 404 when `requested` is not served here.
        """
        if requested is None or requested == "":
            return self.name
        if requested not in self.names:
            raise APIError(
                f"The model `{requested}` does not exist.", 404, "model", "model_not_found"
            )
        return requested

    def card(self, name: str) -> ModelCard:
        """The card of `name` (404 when unknown)."""
        return self.cards[self.names.index(self.resolve(name))]

    def list(self) -> ModelList:
        """`GET /v1/models`."""
        return ModelList(data=self.cards)
