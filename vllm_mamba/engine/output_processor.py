"""Turns each step's samples into the sequences' outputs: the token, its logprobs, the text it
adds (incremental detokenization) and the stop decision; and the prompt logprobs of a prefill.

The engine owns the counters and frees the slots of the sequences this marks finished.
"""

from __future__ import annotations

from typing import Any

from vllm_mamba.engine.detokenizer import IncrementalDetokenizer, find_stop_string
from vllm_mamba.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from vllm_mamba.engine.structured_outputs import accept_token
from vllm_mamba.layers.sampler import SamplerOutput
from vllm_mamba.outputs import Logprob, PositionLogprobs
from vllm_mamba.worker.step import PromptLogprobChunk


class OutputProcessor:
    """Appends sampled tokens to sequences and applies the stop conditions.

    Args:
        tokenizer: the model's tokenizer (detokenization, logprob texts).
        eos_token_id: the end-of-sequence token, if any.
        max_model_len: the longest prompt plus output.
    """

    def __init__(self, tokenizer: Any, eos_token_id: int | None, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.max_model_len = max_model_len
        self._token_text: dict[int, str] = {}

    def append_token(
        self, group: SequenceGroup, seq: Sequence, row: int, out: SamplerOutput, now: float
    ) -> None:
        """Appends the token of row `row` of `out` to `seq`, with its logprobs and text."""
        token = out.token_ids[row]
        params = group.params
        seq.output_token_ids.append(token)
        if group.first_token_time is None:
            group.first_token_time = now
        seq.cumulative_logprob += out.token_logprobs[row]
        if params.logprobs is not None:
            entry = {
                tid: Logprob(lp, rank + 1, self._text_of(tid))
                for rank, (tid, lp) in enumerate(zip(out.topk_ids[row], out.topk_logprobs[row]))
            }
            entry.setdefault(
                token, Logprob(out.token_logprobs[row], out.token_ranks[row], self._text_of(token))
            )
            seq.output_logprobs.append(entry)
        self._check_stop(group, seq, token)

    def _check_stop(self, group: SequenceGroup, seq: Sequence, token: int) -> None:
        """Detokenizes `token` into the sequence's text and applies the stop conditions (a
        complete grammar ends the sequence whatever `ignore_eos` and `min_tokens` say)."""
        params = group.params
        if seq.detokenizer is None:
            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer, seq.prompt_token_ids, params.skip_special_tokens
            )
        grammar_done = seq.matcher is not None and accept_token(seq.matcher, token)
        is_eos = token == self.eos_token_id and (not params.ignore_eos or grammar_done)
        is_stop_token = token in params.stop_token_ids
        new_text = seq.detokenizer.add(token)
        if not (is_eos or is_stop_token) or params.include_stop_str_in_output:
            seq.output_text += new_text
        so = params.structured_outputs
        if so is not None and so.start_after and not seq.grammar_started:
            tail = seq.output_text[-(len(new_text) + len(so.start_after)) :]
            seq.grammar_started = so.start_after in tail
        n_out = len(seq.output_token_ids)
        if n_out >= params.min_tokens or grammar_done:
            if is_eos or is_stop_token or grammar_done:
                seq.status = SequenceStatus.FINISHED_STOPPED
                seq.stop_reason = token if is_stop_token and not is_eos else None
                return
            match = find_stop_string(seq.output_text, len(new_text), params.stop_list)
            if match is not None:
                stop, index = match
                cut = index + len(stop) if params.include_stop_str_in_output else index
                seq.output_text = seq.output_text[:cut]
                seq.status = SequenceStatus.FINISHED_STOPPED
                seq.stop_reason = stop
                return
        if n_out >= group.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.status = SequenceStatus.FINISHED_LENGTH

    def append_prompt_logprobs(self, group: SequenceGroup, chunk: PromptLogprobChunk) -> None:
        """Appends a prefill chunk's prompt logprobs to the request's."""
        assert group.prompt_logprobs is not None and len(group.prompt_logprobs) == chunk.start
        prompt = group.prompt_token_ids
        for j, lp in enumerate(chunk.token_logprobs):
            target = prompt[chunk.start + j]
            entry: PositionLogprobs = {
                tid: Logprob(tlp, rank + 1, self._text_of(tid))
                for rank, (tid, tlp) in enumerate(zip(chunk.topk_ids[j], chunk.topk_logprobs[j]))
            }
            entry.setdefault(target, Logprob(lp, chunk.token_ranks[j], self._text_of(target)))
            group.prompt_logprobs.append(entry)

    def _text_of(self, token_id: int) -> str:
        """The text of one token, cached."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            self._token_text[token_id] = text
        return text
