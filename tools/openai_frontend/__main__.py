"""`python tools/openai_frontend ...`: puts `tools/` and `backend_src/` on the path, runs server.main."""
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
_TOOLS = _HERE.parent
# Running the folder puts it first on the path, where its modules would shadow packages.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
for _path in (_TOOLS.parent / "backend_src", _TOOLS):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from openai_frontend.server import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
