total=0
for f in $@; do
  n=$(wc -l < $f)
  echo "$n $f"
  total=$((total + n))
done
echo "$total total"
