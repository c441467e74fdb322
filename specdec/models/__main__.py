"""``python -m specdec.models``: ``prepare [SPEC ...]`` (for scripts), or the private
``_convert`` child entry point used by :func:`~specdec.models.convert_gguf_to_hf`."""

from __future__ import annotations

import json
import sys

from specdec.models.conversion import _convert_child_main
from specdec.models.resolver import prepare
from specdec.models.spec import default_cache_dir


def main(argv: list[str]) -> int:
    """Run the command in ``argv``; returns the exit status."""
    if argv[:1] == ["_convert"] and len(argv) == 4:
        return _convert_child_main(argv[1], argv[2], argv[3])
    if argv[:1] == ["prepare"]:
        from specdec.logging_util import setup_logging

        setup_logging("info")
        for rm in prepare(argv[1:], default_cache_dir()):
            print(json.dumps({"name": rm.name, "hf_dir": str(rm.hf_dir), "source": rm.source,
                              "sha256": rm.sha256}))
        return 0
    print("usage: python -m specdec.models prepare [SPEC ...]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
