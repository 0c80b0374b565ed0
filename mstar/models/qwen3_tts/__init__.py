"""Qwen3-TTS (12 Hz): the talker and code predictor that turn text into codec frames (config.py,
talker.py, code_predictor.py, weights.py, prompt.py, generate.py), and the 12 Hz speech tokenizer's
decoder that turns the frames into audio (codec*.py)."""
