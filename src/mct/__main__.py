from mct.cli import _under_torchrun, main

code = main()
if _under_torchrun():  # a torchrun worker: its work is done and reported (mct.run.launch.leave)
    from mct.run.launch import leave
    leave(code)
raise SystemExit(code)
