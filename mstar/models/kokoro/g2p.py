"""Text -> Kokoro phonemes, offline: espeak-ng (the library and its data from the
`espeakng-loader` wheel, else a system libespeak-ng) through ctypes, its IPA mapped onto Kokoro's
phoneme set.

Quality relative to misaki (the release's front end): misaki's English G2P looks words up in
curated gold / silver lexicons (about 90 k words each) written in Kokoro's own phoneme
conventions, resolves heteronyms with spaCy part-of-speech tags, normalises numbers, currencies
and abbreviations, and falls back to espeak-ng only for words it does not know. Here every word
goes through espeak-ng's rules and dictionary, then a fixed symbol map (diphthongs and
affricates to Kokoro's single letters A I O W Y Q ʤ ʧ, r-coloured vowels to əɹ / ɜɹ, the flap to
T and the glottal stop to t as Kokoro v1.0 spells them, length marks dropped in American English,
syllabic consonants as ᵊ + consonant, symbols outside the vocabulary dropped). The result is
intelligible with the release's weights but further from its training distribution than misaki's:
vowel qualities and stress placement follow espeak-ng (e.g. "ɑː"-derived vowels, reduced
function words), heteronyms are read as espeak-ng guesses, and abbreviations with a full stop
("Mr.") are split at the stop, since punctuation is cut out and re-inserted around espeak-ng.
Japanese and Mandarin voices need misaki's dedicated front ends: pass `phonemes` for them.

    to_phonemes("Hello, world.", "en-us") == "həlˈO, wˈɜɹld."
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import re
import threading

# a voice name's first letter -> espeak-ng language (voices.py)
VOICE_LANGUAGES = {"a": "en-us", "b": "en-gb", "e": "es", "f": "fr-fr", "h": "hi", "i": "it", "p": "pt-br"}
NEEDS_PHONEMES = {"j": "Japanese", "z": "Mandarin"}

_PUNCT = ";:!?\u2014\u2026\"()\u201c\u201d"
# punctuation runs are cut out and kept; a '.' or ',' between digits stays in the number
_SPLIT = re.compile(r"((?:[" + re.escape(_PUNCT) + r"]|(?<!\d)[.,]|[.,](?!\d))+)")
_TIE = "^"

_COMMON = (("a^ɪ", "I"), ("a^ʊ", "W"), ("e^ɪ", "A"), ("ɔ^ɪ", "Y"), ("d^ʒ", "ʤ"), ("t^ʃ", "ʧ"))
_ENGLISH = (("r", "ɹ"), ("ɐ", "ə"), ("x", "k"), ("ç", "k"), ("ɬ", "l"), ("ʲ", ""), ("\u0303", ""),
            ("ɾ", "T"), ("ʔ", "t"))
_US = (("o^ʊ", "O"), ("ə^ʊ", "O"), ("ɜːɹ", "ɜɹ"), ("ɜː", "ɜɹ"), ("ɚ", "əɹ"), ("ɪ^ə", "iə"), ("ɪə", "iə"),
       ("ː", ""), ("o", "ɔ"), ("e", "A"))
_GB = (("ə^ʊ", "Q"), ("o^ʊ", "Q"), ("e^ə", "ɛː"), ("ɪ^ə", "ɪə"), ("i^ə", "ɪə"), ("ɚ", "ə"), ("o", "ɔ"), ("e", "A"))
_OTHER = (("d^z", "ʣ"), ("o^ʊ", "O"), ("ə^ʊ", "Q"), ("s^s", "S"), ("t^s", "ʦ"), ("-", ""))
_SYLLABIC = re.compile(r"(\S)\u0329")


class G2PUnavailable(RuntimeError):
    """No espeak-ng library (or its data) could be loaded."""


class _Voice(ctypes.Structure):  # espeak_VOICE
    _fields_ = [("name", ctypes.c_char_p), ("languages", ctypes.c_char_p), ("identifier", ctypes.c_char_p),
                ("gender", ctypes.c_ubyte), ("age", ctypes.c_ubyte), ("variant", ctypes.c_ubyte),
                ("xx1", ctypes.c_ubyte), ("score", ctypes.c_int), ("spare", ctypes.c_void_p)]


_PHONEME_MODE = 0x02 | 0x80 | (ord(_TIE) << 8)  # IPA, multi-letter phonemes joined by the tie
_CHARS_UTF8 = 1
_INIT_DONT_EXIT = 0x8000


class _Espeak:
    """The process's libespeak-ng (not thread-safe: every call holds the lock)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.language = None
        lib_path = data_path = None
        try:
            import espeakng_loader
            lib_path, data_path = espeakng_loader.get_library_path(), espeakng_loader.get_data_path()
        except ImportError:
            lib_path = ctypes.util.find_library("espeak-ng")
        if not lib_path:
            raise G2PUnavailable("no espeak-ng: `pip install espeakng-loader` (ships the library and its data), "
                                 "or pass `phonemes` instead of text")
        try:
            lib = ctypes.CDLL(lib_path)
        except OSError as e:
            raise G2PUnavailable(f"espeak-ng library {lib_path!r} does not load: {e}") from None
        lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        lib.espeak_Initialize.restype = ctypes.c_int
        lib.espeak_SetVoiceByProperties.argtypes = [ctypes.POINTER(_Voice)]
        lib.espeak_SetVoiceByProperties.restype = ctypes.c_int
        lib.espeak_TextToPhonemes.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_int]
        lib.espeak_TextToPhonemes.restype = ctypes.c_char_p
        # AUDIO_OUTPUT_SYNCHRONOUS: no audio device, nothing played
        if lib.espeak_Initialize(2, 0, data_path.encode() if data_path else None, _INIT_DONT_EXIT) <= 0:
            raise G2PUnavailable(f"espeak-ng did not initialise (data {data_path!r})")
        self.lib = lib

    def ipa(self, text: str, language: str) -> str:
        with self.lock:
            if language != self.language:
                v = _Voice()
                v.languages = language.encode()
                if self.lib.espeak_SetVoiceByProperties(ctypes.byref(v)) != 0:
                    raise ValueError(f"espeak-ng has no voice for language {language!r}")
                self.language = language
            buf = ctypes.create_string_buffer(text.encode("utf-8"))
            ptr = ctypes.c_void_p(ctypes.addressof(buf))
            clauses = []
            while ptr.value:
                out = self.lib.espeak_TextToPhonemes(ctypes.byref(ptr), _CHARS_UTF8, _PHONEME_MODE)
                if out:
                    clauses.append(out.decode("utf-8"))
            return " ".join(c.strip() for c in clauses if c.strip())


_engine: _Espeak | None = None
_engine_lock = threading.Lock()


def _espeak() -> _Espeak:
    global _engine
    with _engine_lock:
        if _engine is None:
            _engine = _Espeak()
        return _engine


def available() -> bool:
    try:
        _espeak()
        return True
    except G2PUnavailable:
        return False


def language_of_voice(voice: str | None) -> str:
    """The espeak-ng language of a Kokoro voice name (American English when it says none)."""
    head = (voice or "a")[:1].lower()
    if head in NEEDS_PHONEMES:
        raise ValueError(f"voice {voice!r} is {NEEDS_PHONEMES[head]}: this front end has no {NEEDS_PHONEMES[head]} "
                         "G2P; pass `phonemes` (misaki's output) instead of text")
    return VOICE_LANGUAGES.get(head, "en-us")


def map_ipa(ipa: str, language: str) -> str:
    """espeak-ng's tied IPA -> Kokoro's phoneme conventions (still with symbols outside the vocab)."""
    table = _COMMON
    if language.startswith("en"):
        table = table + (_GB if language == "en-gb" else _US) + _ENGLISH
        ipa = _SYLLABIC.sub(lambda mt: "ᵊ" + mt.group(1), ipa)
    else:
        table = table + _OTHER
    for old, new in sorted(table, key=lambda kv: -len(kv[0])):
        ipa = ipa.replace(old, new)
    return ipa.replace(_TIE, "").replace("\u0329", "")


@functools.lru_cache(maxsize=4096)
def to_phonemes(text: str, language: str = "en-us", vocab: frozenset[str] | None = None) -> str:
    """Kokoro phonemes of `text`; with `vocab`, symbols outside it dropped."""
    eng = _espeak()
    text = text.replace("\u00ab", "\u201c").replace("\u00bb", "\u201d")
    out = []
    for k, piece in enumerate(_SPLIT.split(text)):
        if not piece:
            continue
        if k % 2:  # punctuation, kept as written
            out.append(piece)
            continue
        ps = map_ipa(eng.ipa(piece, language), language)
        if not ps.strip():
            if piece[:1].isspace() or piece[-1:].isspace():
                out.append(" ")
            continue
        out.append((" " if piece[:1].isspace() and out else "") + ps.strip() + (" " if piece[-1:].isspace() else ""))
    ps = re.sub(r"\s+", " ", "".join(out)).strip()
    if vocab is not None:
        ps = "".join(ch for ch in ps if ch in vocab)
    return ps


__all__ = ["G2PUnavailable", "VOICE_LANGUAGES", "available", "language_of_voice", "map_ipa", "to_phonemes"]
