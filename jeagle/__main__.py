"""`python -m jeagle` is `python -m jeagle.generate`."""

from jeagle.generate import exit_now, main

exit_now(main())
