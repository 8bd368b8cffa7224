from .loop.cli import main

raise SystemExit(main())
