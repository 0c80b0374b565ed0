"""SNAC (multi-scale neural audio codec), decode direction: the codec stage of speech models
that emit SNAC codes (Orpheus TTS). model.py: the decoder and its checkpoint loading;
streaming.py: batched sliding-window decode of flat 7-code frames; presets.py: published configs."""

from mstar.models.snac.model import (SNACConfig, SNACDecoder, build_snac_decoder, decoder_state_dict,  # noqa: F401
                                     fold_weight_norm, load_snac_decoder, read_snac_config)
from mstar.models.snac.presets import PRESETS, SNAC_24KHZ  # noqa: F401
from mstar.models.snac.streaming import (codes_from_frames, decode_stream, decode_tail, decode_windows,  # noqa: F401
                                         sliding_windows)
