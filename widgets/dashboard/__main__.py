"""`python -m widgets.dashboard ...` is `workbench dashboard ...`; `--app-path` prints the file for `panel serve`."""
import sys
from pathlib import Path

if sys.argv[1:] == ["--app-path"]:
    print(Path(__file__).with_name("panel_app.py"))
    sys.exit(0)

from widgets.dashboard.serve import main  # noqa: E402

sys.exit(main())
