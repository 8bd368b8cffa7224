"""python -m bench [--quick] [--ops ...] [--backends ...] [--device cpu|cuda] [--out DIR]"""
from .run import main

raise SystemExit(main())
