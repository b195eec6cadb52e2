"""Creates /app/shop.db with deterministic contents."""
import random
import sqlite3

rng = random.Random(2026)
db = sqlite3.connect("/app/shop.db")
db.executescript("""
CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT NOT NULL);
CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER REFERENCES customers(id));
CREATE TABLE order_items (order_id INTEGER REFERENCES orders(id), sku TEXT,
                          quantity INTEGER, price REAL);
""")
names = ["ana", "bo", "cy", "dee", "eli", "fay", "gus", "hal"]
db.executemany("INSERT INTO customers VALUES (?, ?)", list(enumerate(names, 1)))
for oid in range(1, 61):
    db.execute("INSERT INTO orders VALUES (?, ?)", (oid, rng.randint(1, len(names))))
    for _ in range(rng.randint(1, 4)):
        db.execute(
            "INSERT INTO order_items VALUES (?, ?, ?, ?)",
            (oid, f"sku{rng.randint(1, 30)}", rng.randint(1, 5), rng.choice([2.5, 4.0, 9.99, 20.0])),
        )
db.commit()
