from longdoc.cli import main

raise SystemExit(main())
