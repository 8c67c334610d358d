"""`python -m jeagle` is `python -m jeagle.generate`."""

import sys

from jeagle.generate import main

sys.exit(main())
