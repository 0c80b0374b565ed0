"""Engine requests from a family's planned requests (plain fields: prompt ids, SamplingParams
fields, the admission stage's input, suppression lists), as a transcriber plans them."""

from __future__ import annotations

from mstar.runtime.engine.request import EngineRequest, SamplingParams


def sampling_params(planned) -> SamplingParams:
    """The planned request's SamplingParams, validated (RequestError names a bad field)."""
    params = SamplingParams(**planned.sampling)
    params.validate()
    return params


def engine_request(request_id: str, planned, eos_token_ids: tuple[int, ...] = ()) -> EngineRequest:
    return EngineRequest(request_id, list(planned.prompt_ids), sampling_params(planned), eos_token_ids=eos_token_ids,
                         encoder_input=planned.encoder_input, suppress_token_ids=planned.suppress_token_ids,
                         begin_suppress_token_ids=planned.begin_suppress_token_ids)
