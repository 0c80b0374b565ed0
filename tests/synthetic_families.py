"""A model plugin for the tests: registers the toy non-autoregressive families of toy_stages.py
("toy-speech": SYNTHESIZES_SPEECH; "toy-image": GENERATES_IMAGES and GENERATES_VIDEO).

    MSTAR_MODEL_PLUGINS=synthetic_families PYTHONPATH=tests python -m mstar.runtime.serve toy-image
"""

from mstar.models.registry import register
from toy_stages import FAMILIES

for _family in FAMILIES:
    register(_family)
