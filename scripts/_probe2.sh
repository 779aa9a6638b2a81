# GPU tests with the persistent MLP half on, then bench rollout with it off and on (7B NVFP4, LoRA r32)
cd $T
(QERL_DECODE_LAYER=1 TRITON_INTERPRET=0 timeout 240 python3 -m pytest -q -rf --tb=short -p no:cacheprovider --rootdir $REPO $REPO/tests/test_rollout_cuda.py > $OUT/gputests_dl1.log 2>&1; echo "gputests rc $?"; tail -5 $OUT/gputests_dl1.log)
for DL in 0 1; do
  F=nvfp4; [ $DL = 1 ] && F=bf16,nvfp4
  QERL_DECODE_LAYER=$DL timeout 150 python3 -c "from qerl_cli.cli import main; main()" bench rollout --shape qwen2.5-7b --formats $F --batches 8,16 --new-tokens 128 --profile --out $OUT/rollout_dl$DL > $OUT/rollout_dl$DL.log 2>&1
  echo "rollout DL=$DL rc $?"; tail -14 $OUT/rollout_dl$DL.log
done
