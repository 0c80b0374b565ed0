"""`mstar bench images`: `mstar bench video` asking for one frame (an image) per request; the
flags and records are video.py's (default size 1280x704, records in notes/results/images.jsonl)."""

from __future__ import annotations

import sys

from mstar.bench import video


def main(argv=None) -> int:
    return video.main(argv, kind="images")


if __name__ == "__main__":
    sys.exit(main())
