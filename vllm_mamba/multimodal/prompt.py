"""A prompt with images, after preprocessing: the token ids with each image's placeholder
expanded, where each image's encoder rows go, the M-RoPE positions, and the keys the prefix
cache files the prompt under.

`expand_prompt` takes the tokenised prompt (each image marked by ONE placeholder token, as the
chat templates write it: Qwen's `<|image_pad|>`, LFM2-VL's `<image>`) and the processed images
in prompt order, and replaces each placeholder with the image's `token_ids`.

The prefix cache keys a prompt by its tokens, and every image's placeholder tokens are the
same ids; so `MultiModalPrompt.cache_keys` is the token ids with each image's embedding
positions replaced by negative keys derived from the image's content hash: two prompts with
the same text and the same image share their prefix, a different image does not.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_mamba.multimodal.inputs import ProcessedImage


@dataclass(frozen=True)
class PromptImage:
    """One image of a prompt: its processed form and where its tokens start."""

    offset: int  # the prompt position of `image.token_ids[0]`
    image: ProcessedImage

    @property
    def positions(self) -> tuple[int, ...]:
        """The prompt positions that take the encoder's output rows, in row order."""
        return tuple(self.offset + o for o in self.image.embed_offsets)


@dataclass(frozen=True)
class MultiModalPrompt:
    """The images of an expanded prompt.

    Attributes:
        images: in prompt order.
        rope_rows: M-RoPE models: the `(time, height, width)` rotary positions of every
            prompt token; None otherwise.
        rope_shift: M-RoPE: a token after the prompt at index `i` rotates at `i + rope_shift`.
        cache_keys: the prefix cache's keys of the prompt (see the module docstring).
        marks: where each image's placeholder was in the prompt as given.
    """

    images: list[PromptImage]
    rope_rows: list[list[int]] | None = None
    rope_shift: int = 0
    cache_keys: list[int] = field(default_factory=list)
    marks: tuple[int, ...] = ()

    @property
    def expansion(self) -> int:
        """Tokens the expanded prompt has more than the prompt as given."""
        return sum(len(p.image.token_ids) - 1 for p in self.images)

    def expanded_offset(self, offset: int) -> int:
        """An offset into the prompt as given, in the expanded prompt (a placeholder before
        it counts its image's tokens)."""
        return offset + sum(
            len(p.image.token_ids) - 1 for mark, p in zip(self.marks, self.images) if mark < offset
        )

    def rope_positions(self, start: int, end: int) -> list[list[int]]:
        """The three M-RoPE rows of positions `[start, end)` (prompt or after it)."""
        assert self.rope_rows is not None
        prompt_len = len(self.rope_rows[0])
        head = [row[start:end] for row in self.rope_rows]
        tail = list(range(max(start, prompt_len) + self.rope_shift, end + self.rope_shift))
        return [h + tail for h in head]


def image_keys(image: ProcessedImage) -> list[int]:
    """Negative prefix-cache keys of an image's embedding rows, from its content hash."""
    base = int(image.content_hash[:15] or "0", 16) << 24
    return [-(1 + base + j) for j in range(len(image.embed_offsets))]


def expand_prompt(
    ids: list[int],
    images: list[ProcessedImage],
    placeholder_id: int,
    mrope: bool,
) -> tuple[list[int], MultiModalPrompt]:
    """`ids` with each placeholder token replaced by its image's tokens, and the images'
    placement.

    Raises:
        ValueError: the number of placeholder tokens is not the number of images.
    """
    marks = [i for i, t in enumerate(ids) if t == placeholder_id]
    if len(marks) != len(images):
        raise ValueError(
            f"multi_modal_data: the prompt has {len(marks)} image placeholder token(s) (id "
            f"{placeholder_id}) for {len(images)} image(s): put one placeholder where each "
            "image goes (the chat template does this for image parts)"
        )
    out: list[int] = []
    keys: list[int] = []
    placed: list[PromptImage] = []
    last = 0
    for mark, image in zip(marks, images):
        out.extend(ids[last:mark])
        keys.extend(ids[last:mark])
        placed.append(PromptImage(len(out), image))
        own = list(image.token_ids)
        image_key = image_keys(image)
        for j, offset in enumerate(image.embed_offsets):
            own[offset] = image_key[j]
        out.extend(image.token_ids)
        keys.extend(own)
        last = mark + 1
    out.extend(ids[last:])
    keys.extend(ids[last:])
    rows, shift = None, 0
    if mrope:
        rows, shift = mrope_rows(len(out), placed)
    return out, MultiModalPrompt(placed, rows, shift, keys, tuple(marks))


def mrope_rows(num_tokens: int, images: list[PromptImage]) -> tuple[list[list[int]], int]:
    """The M-RoPE rows of a prompt of `num_tokens` tokens and the shift of the tokens after
    it, as transformers' `get_rope_index`: text advances one position per token; an image's
    embedding tokens sit at `(start + t, start + row, start + col)` of its `(t, h, w)` grid in
    LLM tokens, and the text after it continues at `start + max(h, w)`."""
    rows: list[list[int]] = [[], [], []]
    index = position = 0
    for placed in images:
        grid = placed.image.grid
        if grid is None:
            raise ValueError("an M-RoPE model's image processor must give each image's grid")
        t, h, w = grid
        first = placed.positions[0] if placed.positions else placed.offset
        for row in rows:  # the text before the image's embedding tokens
            row.extend(range(position, position + first - index))
        position += first - index
        for ti in range(t):
            for hi in range(h):
                rows[0].extend([position + ti] * w)
                rows[1].extend([position + hi] * w)
                rows[2].extend(range(position, position + w))
        index = first + t * h * w
        position += max(h, w)
    for row in rows:
        row.extend(range(position, position + num_tokens - index))
    return rows, position - index


__all__ = ["MultiModalPrompt", "PromptImage", "expand_prompt", "image_keys", "mrope_rows"]
