from mct.cli import main

raise SystemExit(main())
