import os

from mct.cli import main

code = main()
if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun worker: its work is done and reported (mct.run.launch.leave)
    from mct.run.launch import leave
    leave(code)
raise SystemExit(code)
