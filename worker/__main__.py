from worker.cli.cli import main

raise SystemExit(main())
