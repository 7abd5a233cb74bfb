import sys

from keras_gradboost.cli import main

sys.exit(main())
