from lowbit.cli import main

raise SystemExit(main())
