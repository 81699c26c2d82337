from chatd.cli import main

raise SystemExit(main())
