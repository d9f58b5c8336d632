import sys

from kvcompress.profile_model.command import main

sys.exit(main())
