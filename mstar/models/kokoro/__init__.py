"""Kokoro-82M (hexgrad/Kokoro-82M: StyleTTS2 with an iSTFTNet decoder, 24 kHz) text-to-speech,
run by the stage engine as one one-shot stage (no autoregression: one forward per batch).

    config.py        KokoroConfig: the release's config.json
    presets.py       kokoro-82m (published shape), tiny-kokoro (embedded), the phoneme vocabulary
    plbert.py        the PL-BERT (ALBERT on the op layer, packed tokens)
    blocks.py        masked building blocks: instance / layer norms with style, AdaIN res-blocks, LSTMs
    text_encoder.py  conv + LSTM phoneme encoder
    prosody.py       duration encoder, duration / F0 / energy predictor
    source.py        harmonic-plus-noise source (per-row generators)
    istftnet.py      decoder and iSTFTNet generator
    model.py         KokoroModel: the batched forward (SynthesisRow -> SynthesisOutput)
    weights.py       the release's checkpoint layout (config.json, kokoro-v1_0.pth, voices/)
    voices.py        voice tables
    g2p.py           text -> phonemes through espeak-ng (offline)
    pipeline.py      KokoroPipeline: requests -> rows -> AudioChunks
    family.py        the registry entry

Importing the package (and family.py, which the registry imports) loads no torch: import the
modules themselves, e.g. `from mstar.models.kokoro.model import KokoroModel`.
"""
