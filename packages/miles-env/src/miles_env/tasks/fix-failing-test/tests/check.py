"""The original tests, plus hidden ones, against /app/stats.py."""
import subprocess
import sys

code = """
import sys, unittest
sys.path.insert(0, '/app')
sys.path.insert(0, '/tests')
from stats import median
assert median([1, 2, 3, 4, 5, 6]) == 3.5, median([1, 2, 3, 4, 5, 6])
assert median([10, 20]) == 15, median([10, 20])
assert median([7]) == 7
suite = unittest.defaultTestLoader.loadTestsFromName('original_test_stats')
result = unittest.TextTestRunner(verbosity=0).run(suite)
sys.exit(0 if result.wasSuccessful() else 1)
"""
r = subprocess.run([sys.executable, "-c", code], cwd="/app")
sys.exit(r.returncode)
