import logging

# The one logger of the package; applications decide handlers and levels.
logger = logging.getLogger("loong_data")
