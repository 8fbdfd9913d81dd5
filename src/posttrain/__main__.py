from posttrain.cli import main

raise SystemExit(main())
